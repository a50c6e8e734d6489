"""``onnxgen bench --workload``: each workload against a real ``onnxgen serve`` on a tiny model (tiny
settings), the client-side counts checked against what the server reported, and the summary's arithmetic
on records with known times."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from onnxgen.bench.genai_engine import GENAI, BenchError
from onnxgen.bench.workload_engines import LLAMA_CPP, ONNXGEN
from onnxgen.bench.workload_run import (
    WorkloadConfig,
    available_engines,
    format_workload_report,
    from_json,
    group_metrics,
    run_workloads,
    to_json,
)
from onnxgen.bench.workloads import WORKLOADS, build, code_file
from onnxgen.cli import main
from onnxgen.testing import TinySpec, build_model

# the workloads' prompts are ~3.7k tokens in the tiny models' byte-level tokenizer
LONG = TinySpec(max_position=8192)
SERVER_FLAGS = ("--max-model-len", "8192", "--prefix-cache-mb", "64")
PLAIN_FLAGS = ("--max-model-len", "8192", "--prefix-cache-mb", "0")
SERVER = "onnxgen --max-model-len 8192 --prefix-cache-mb 64"  # the engine's name in the report
PLAIN = "onnxgen --max-model-len 8192 --prefix-cache-mb 0"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("workloads") / "genai-dense", "genai-dense", LONG)


def _config(model: Path, *engines: str, **kw: object) -> WorkloadConfig:
    tiny_settings = dict(threads=1, rounds=2, max_tokens=4, turns=2, edits=1, questions=1)
    settings: dict = {"server_flags": (SERVER_FLAGS,), **tiny_settings, **kw}
    return WorkloadConfig(str(model), engines=engines, **settings)


def test_each_workload_runs_against_the_server_and_counts_what_it_reports(tiny: Path) -> None:
    report = run_workloads(_config(tiny, ONNXGEN, server_flags=(SERVER_FLAGS, PLAIN_FLAGS)))
    assert list(report.table) == [SERVER, PLAIN]
    assert len(report.requests) == 2 * 2 * (2 + 1 + 1)  # servers x rounds x (chat turns + edits + questions)
    for r in report.requests:
        assert r["tokens"] == r["usage_tokens"], r  # every token streamed was counted, none twice
        assert 1 <= r["tokens"] <= 4
        stamps = r["stamps_s"]
        assert stamps[0] > 0 and stamps == sorted(stamps) and stamps[-1] <= r["total_s"]
    cached = [r for r in report.requests if r["engine"] == SERVER]
    plain = [r for r in report.requests if r["engine"] == PLAIN]
    for a, b in zip(cached, plain, strict=True):  # the same requests, the same greedy replies
        assert (a["workload"], a["round"], a["index"], a["prompt_tokens"], a["text"]) == (
            b["workload"],
            b["round"],
            b["index"],
            b["prompt_tokens"],
            b["text"],
        )
        assert b["cached_tokens"] == 0  # each server got its own flags
    chat = [r for r in cached if r["workload"] == "chat"]
    first, second = chat[0], chat[1]
    # the second turn sends the first turn, its reply and the new message
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["tokens"]
    assert second["cached_tokens"] >= first["prompt_tokens"]
    # a new round starts cold: its first turn shares only the template's opening with the last round
    opening = "<|im_start|>system\nSession "  # at most a token a character
    assert chat[2]["round"] == 1 and chat[2]["cached_tokens"] <= len(opening) < first["prompt_tokens"] // 4
    edit = next(r for r in cached if r["workload"] == "code-edit")
    assert edit["prompt_tokens"] > len(code_file()) // 2  # the whole file is in the prompt
    table = report.table[SERVER]
    assert set(table) == set(WORKLOADS)
    assert set(table["chat"]) == {"first", "later", "all"} and set(table["rag"]) == {"first", "all"}
    for groups in table.values():
        for m in groups.values():
            assert m["ttft_p50_ms"] > 0 and m["ttft_p90_ms"] >= m["ttft_p50_ms"] and m["tok_s"] > 0
    rounds = [sum(r["tokens"] for r in chat if r["round"] == i) for i in range(2)]
    assert table["chat"]["all"]["tokens"] == statistics.median(rounds)
    text = format_workload_report(report)
    assert "code-edit" in text and "later" in text and f"| {PLAIN} " in text
    said = report.server_said[SERVER]
    assert said[-1].startswith("listening on") and "8192 tokens per sequence" in said[-1]
    assert format_workload_report(from_json(to_json(report))) == text  # --json, printed later


def test_the_summary_of_known_times() -> None:
    records = [
        {"prompt_tokens": 10, "cached_tokens": 0, "tokens": 3, "stamps_s": [0.1, 0.2, 0.4], "total_s": 0.5},
        {"prompt_tokens": 30, "cached_tokens": 9, "tokens": 2, "stamps_s": [0.3, 0.4], "total_s": 0.5},
    ]
    m = group_metrics(records)
    assert m["requests"] == 2 and m["prompt_tokens"] == 20 and m["cached_tokens"] == 4.5 and m["tokens"] == 5
    assert m["ttft_p50_ms"] == pytest.approx(200.0)  # between 0.1 and 0.3
    assert m["itl_p50_ms"] == pytest.approx(100.0)  # gaps 0.1, 0.2, 0.1
    assert m["itl_p90_ms"] == pytest.approx(180.0)
    assert m["decode_tok_s"] == pytest.approx(3 / 0.4)  # 3 gaps over 0.3 s + 0.1 s of decoding
    assert m["tok_s"] == pytest.approx(5 / 1.0)


def test_a_chat_keeps_its_history_and_the_other_workloads_do_not() -> None:
    chat = build("chat", 0, turns=3, edits=1, questions=1)
    assert chat.keep_history and len(chat.user) == 3
    edits = build("code-edit", 0, turns=1, edits=2, questions=1)
    assert not edits.keep_history and "`chunks` to `parts`" in edits.user[0]
    assert all(code_file() in u for u in edits.user)
    rag = build("rag", 1, turns=1, edits=1, questions=2)
    assert rag.system != build("rag", 0, turns=1, edits=1, questions=2).system  # rounds differ up front
    assert rag.user[0].split("Question:")[0] == rag.user[1].split("Question:")[0]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"workloads": ("chat", "essay")}, "--workload 'essay'"),
        ({"rounds": 0}, "--rounds must be at least 1"),
        ({"max_tokens": 0}, "--max-tokens must be at least 1"),
        ({"engines": ("vllm",)}, "--engines 'vllm'"),
        ({"server_flags": ((), ())}, "--server-flags must name each onnxgen server once"),
    ],
)
def test_bad_settings_are_named(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadConfig("m", 1, **kw)
    with pytest.raises(ValueError, match="--chat-turns must be between 1 and 10"):
        build("chat", 0, turns=11, edits=1, questions=1)


def test_an_engine_asked_for_by_name_must_be_able_to_run(tiny: Path) -> None:
    with pytest.raises(BenchError, match=r"--engines llama\.cpp: .*(--gguf|llama-cpp-python)"):
        available_engines(_config(tiny, LLAMA_CPP))
    names, skipped = available_engines(WorkloadConfig(str(tiny), 1))  # by default: the rest are skipped
    assert names[0] == ONNXGEN and LLAMA_CPP in skipped and LLAMA_CPP not in names


def test_the_cli_names_a_bad_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "some-model", "--workload", "essay"]) != 0
    assert "--workload 'essay'" in capsys.readouterr().err


@pytest.mark.external
@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai absent")
def test_onnxruntime_genai_runs_the_same_workloads_on_the_same_prompt_tokens(tiny: Path) -> None:
    report = run_workloads(_config(tiny, ONNXGEN, GENAI, rounds=1))
    ours = [r for r in report.requests if r["engine"] == SERVER]
    theirs = [r for r in report.requests if r["engine"] == GENAI]
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs, strict=True):
        assert 1 <= b["tokens"] <= 4 and b["usage_tokens"] is None
        if a["index"] == 0:  # the same messages: the same template, the same tokens
            assert a["prompt_tokens"] == b["prompt_tokens"], (
                a["workload"],
                a["prompt_tokens"],
                b["prompt_tokens"],
            )
    assert set(report.table[GENAI]) == set(WORKLOADS)


def _tiny_gguf(path: Path, template: str) -> Path:
    """A random-weight llama GGUF of two layers whose tokenizer spells text in bytes."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = [*specials, "\u2581", *(f"<0x{b:02X}>" for b in range(256))]  # (U+2581: a space)
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL]
    types += [gguf.TokenType.BYTE] * 256
    embd, ff, heads, kv_heads, layers = 64, 128, 4, 2, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(8192)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(embd // heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab)
    w.add_token_scores([0.0] * len(vocab))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(template)
    rng = np.random.default_rng(0)
    kv = kv_heads * embd // heads
    shapes = {"token_embd": (len(vocab), embd), "output": (len(vocab), embd)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q": (embd, embd),
            f"blk.{i}.attn_k": (kv, embd),
            f"blk.{i}.attn_v": (kv, embd),
        }
        shapes |= {f"blk.{i}.attn_output": (embd, embd), f"blk.{i}.ffn_gate": (ff, embd)}
        shapes |= {f"blk.{i}.ffn_up": (ff, embd), f"blk.{i}.ffn_down": (embd, ff)}
        shapes |= {f"blk.{i}.attn_norm": (embd,), f"blk.{i}.ffn_norm": (embd,)}
    for name, shape in {**shapes, "output_norm": (embd,)}.items():
        norm = len(shape) == 1
        w.add_tensor(
            f"{name}.weight",
            np.ones(shape, np.float32) if norm else rng.normal(0, 0.05, shape).astype(np.float32),
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.external
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python absent")
def test_llama_cpp_runs_the_workloads_reusing_the_prefix_it_holds(tiny: Path, tmp_path: Path) -> None:
    template = json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    gguf_file = _tiny_gguf(tmp_path / "tiny.gguf", template)
    report = run_workloads(_config(tiny, LLAMA_CPP, gguf=str(gguf_file)))
    assert len(report.requests) == 2 * 4 and set(report.table[LLAMA_CPP]) == set(WORKLOADS)
    chat = [r for r in report.requests if r["workload"] == "chat"]
    assert chat[1]["prompt_tokens"] > chat[0]["prompt_tokens"] + chat[0]["tokens"]
    assert chat[1]["cached_tokens"] >= chat[0]["prompt_tokens"]  # llama.cpp kept the first turn
    opening = "<|im_start|>system\nSession "
    assert chat[2]["round"] == 1 and chat[2]["cached_tokens"] <= len(opening)
    for r in report.requests:
        assert 1 <= r["tokens"] <= 4 and r["stamps_s"] == sorted(r["stamps_s"]) and r["stamps_s"][0] > 0


def test_a_server_that_does_not_start_is_reported_with_its_own_words(tiny: Path) -> None:
    cfg = WorkloadConfig(str(tiny), 1, engines=(ONNXGEN,), server_flags=(("--no-such-flag",),))
    with pytest.raises(BenchError, match=r"onnxgen serve exited with 2(?s:.)*--no-such-flag"):
        run_workloads(cfg)


def test_a_prompt_past_the_servers_context_names_the_request_and_the_flag(tiny: Path) -> None:
    flags = (("--max-model-len", "1024"),)  # shorter than the file
    cfg = WorkloadConfig(
        str(tiny), 1, ("code-edit",), rounds=1, edits=1, engines=(ONNXGEN,), server_flags=flags
    )
    with pytest.raises(
        BenchError,
        match=r"onnxgen --max-model-len 1024, code-edit request 1 \(round 1\): .*--max-model-len N",
    ):
        run_workloads(cfg)
