"""``onnxgen generate`` flags for people coming from llama.cpp / ollama: sampling defaults, ``--temp``,
``--system``, inline ``--grammar``, ``--stream --json``, the clip notice, the one-token stats line, flag words
in errors and the loading line on a terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from onnxgen.cli import build_parser, main
from onnxgen.cli.generate import SAMPLING_DEFAULTS, sampling_params
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import LLM, load
from onnxgen.testing import build_model

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("flags"), "genai-dense")


@pytest.fixture(scope="module")
def dense_llm(dense_dir: Path) -> LLM:
    return load(dense_dir, threads=1)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)
    monkeypatch.delenv("ONNXGEN_THREADS", raising=False)


def _params(*flags: str) -> SamplingParams:
    return sampling_params(build_parser().parse_args(["generate", "p", *flags]), SAMPLING_DEFAULTS)


def test_sampling_defaults_are_llama_cpp_s_and_t_0_is_plain_greedy() -> None:
    assert _params() == SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1
    )
    assert _params("--temp", "0") == SamplingParams()  # greedy: no filters, no penalty
    assert _params("--temp", "0", "--repetition-penalty", "1.3") == SamplingParams(repetition_penalty=1.3)
    assert _params("--temp", "0.5", "--top-k", "0").temperature == 0.5
    assert _params("--temp", "0.5", "--top-k", "0").top_k == 0  # a flag wins over a default


def test_system_is_the_system_message(
    dense_dir: Path, dense_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    expected = dense_llm.chat(messages, SamplingParams(max_new_tokens=6))
    argv = [
        "generate",
        str(dense_dir),
        PROMPT,
        "-n",
        "6",
        "--temp",
        "0",
        "--system",
        "be brief",
        "--no-stats",
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out == expected.text + "\n"


def test_an_inline_grammar_constrains_the_output(dense_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grammar = 'start: "yes" | "no"'
    assert main(["generate", str(dense_dir), PROMPT, "--grammar", grammar, "--seed", "1", "--no-stats"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")


def test_stream_json_writes_one_line_per_piece_and_the_finish_last(
    dense_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(dense_dir), PROMPT, "-n", "7", "--temp", "0", "--ignore-eos", "--json"]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*argv, "--stream"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) > 1
    assert "".join(line["text"] for line in lines) == whole["text"]
    assert [i for line in lines for i in line["token_ids"]] == whole["token_ids"]
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["stats"]["generated_tokens"] == 7
    assert all("finish_reason" not in line for line in lines[:-1])


def test_a_clipped_max_new_tokens_is_noticed_and_one_token_has_no_decode_rate(
    dense_dir: Path, dense_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    context = dense_llm.package.context_length
    assert context is not None
    argv = ["generate", str(dense_dir), PROMPT, "--temp", "0", "--ignore-eos", "--no-stream"]
    assert main([*argv, "-n", str(context + 50)]) == 0
    err = capsys.readouterr().err
    assert f"-n {context + 50} was clipped to" in err and f"{context}-token context" in err
    assert main([*argv, "-n", "1"]) == 0
    err = capsys.readouterr().err
    assert "clipped" not in err
    assert "generated 1 tokens" in err and "decode n/a" in err and "0.0 tok/s" not in err


def test_a_bad_seed_is_reported_in_flag_words(dense_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(dense_dir), PROMPT, "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--seed must be an integer >= 0 (got -1)" in err and "omit --seed" in err and "None" not in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_loading_is_announced_with_its_time_on_a_terminal_only(
    dense_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(dense_dir), PROMPT, "-n", "2"]
    assert main(argv) == 0
    assert "loading" not in capsys.readouterr().err  # a pipe or a log: no progress line
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(argv) == 0
    first = terminal.getvalue().splitlines()[0]
    assert first.startswith(f"[onnxgen] loading {dense_dir} ... ") and first.endswith(" s")


def test_a_hub_id_not_in_the_hub_cache_says_how_to_pull_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Qwen/Qwen3-0.6B", PROMPT]) == 2
    err = capsys.readouterr().err
    assert "Qwen/Qwen3-0.6B is not a local path and not in the Hugging Face cache" in err
    assert "onnxgen pull Qwen/Qwen3-0.6B" in err and err.count("\n") == 1
    assert main(["generate", "no_such_dir", PROMPT]) == 2
    err = capsys.readouterr().err  # a plain missing directory is only that
    assert "model no_such_dir does not exist" in err and "Hugging Face cache" not in err
