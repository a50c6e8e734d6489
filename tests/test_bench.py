"""``onnxgen bench``: JSON/table reports from real worker processes, interleaving and statistics with
fake workers, the onnxruntime-genai side (when installed) and the errors."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from onnxgen import bench
from onnxgen.bench import BenchConfig, OnnxgenEngine, decode_rate, run_bench, synthetic_prompt
from onnxgen.bench_worker import process_threads
from onnxgen.cli import main
from onnxgen.cli_bench import format_report
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import load
from onnxgen.testing import build_model

HAS_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None
GENAI = "onnxruntime-genai"
QUICK = [
    "--runs",
    "1",
    "--warmups",
    "0",
    "--new-tokens",
    "4",
    "--prompt-tokens",
    "4",
    "--threads",
    "1",
    "--json",
]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("bench-dense"), "genai-dense")


@pytest.fixture(scope="module")
def hybrid_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = build_model(tmp_path_factory.mktemp("bench-hybrid"), "hybrid-genai")
    cfg = BenchConfig(str(model), prompt_tokens=(4,), new_tokens=4, warmups=0, runs=1, threads=1)
    return run_bench(cfg, log=lambda _: None)


def test_bench_json_reports_prefill_ttft_decode_and_rss_of_the_onnxgen_worker(
    dense_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", str(dense_dir), *QUICK]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"model", "threads", "new_tokens", "runs", "warmups", "decode_skip", "machine", "results"} <= set(
        report
    )
    assert report["threads"] == 1 and report["new_tokens"] == 4
    assert {"cpu", "cores_available", "onnxruntime", "loadavg_start", "loadavg_end"} <= set(report["machine"])
    [entry] = report["results"]
    assert entry["prompt_tokens"] == 4 and set(entry["engines"]) == {"onnxgen"}
    e = entry["engines"]["onnxgen"]
    for key in ("prefill_ms", "ttft_ms", "decode_tok_s"):
        assert set(e[key]) == {"median", "min", "max"} and e[key]["median"] > 0
    assert e["prefill_ms"]["median"] <= e["ttft_ms"]["median"]
    assert len(e["runs"]) == 1
    assert e["peak_rss_mb"] > 10  # onnxruntime alone takes more than this
    assert e["process_threads"] >= 1


def test_bench_table_has_one_row_per_engine_and_prompt_length_and_states_the_machine(
    hybrid_report: dict[str, Any],
) -> None:
    text = format_report(hybrid_report)
    assert "machine: " in text and "cores available" in text and "1 intra-op threads" in text
    e = hybrid_report["results"][0]["engines"]["onnxgen"]
    row = next(line for line in text.splitlines() if line.lstrip().startswith("4  onnxgen"))
    assert f"{e['decode_tok_s']['median']:.1f}" in row.split()


class _FakeWorker:
    """Stands in for a worker process: records the order of runs, returns scripted timings."""

    order: list[str] = []  # noqa: RUF012 (shared log of one test)

    def __init__(self, engine: str, model: str, threads: int) -> None:
        self.engine = engine
        self.calls = 0
        self.info = {"vocab_size": 50, "context_length": 40, "version": "t", "process_threads": 2 + threads}

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        assert list(prompt) == synthetic_prompt(len(prompt), 50)
        self.calls += 1
        self.order.append(self.engine)
        slow = 2.0 if self.engine == GENAI else 1.0
        return {
            "prefill_ms": 10.0 * self.calls * slow,
            "ttft_ms": 11.0 * self.calls * slow,
            "step_ms": [100.0] + [self.calls * slow] * (new_tokens - 2),  # a slow first decode step
            "token_ids": [7] * new_tokens if self.engine == "onnxgen" else [7, 7, 8] + [7] * (new_tokens - 3),
            "peak_rss_mb": 100.0 * slow + self.calls,
        }

    def close(self) -> None:
        pass


def test_bench_interleaves_engines_drops_warmups_and_reports_medians_and_ratios(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "require_genai", lambda: None)
    monkeypatch.setattr(bench, "Worker", _FakeWorker)
    _FakeWorker.order = []
    cfg = BenchConfig(
        "m", prompt_tokens=(5,), new_tokens=6, warmups=1, runs=3, decode_skip=1, threads=2, compare=GENAI
    )
    [entry] = run_bench(cfg, log=lambda _: None)["results"]
    assert _FakeWorker.order == ["onnxgen", GENAI] * 4
    ours, theirs = entry["engines"]["onnxgen"], entry["engines"][GENAI]
    # measured calls are 2, 3, 4; decode skips the slow first step: 4 steps of `calls` ms each
    assert ours["decode_tok_s"] == {"median": 1000.0 / 3, "min": 1000.0 / 4, "max": 1000.0 / 2}
    assert theirs["decode_tok_s"]["median"] == pytest.approx(1000.0 / 6)
    assert ours["prefill_ms"]["median"] == 30.0 and ours["ttft_ms"]["max"] == 44.0
    assert ours["peak_rss_mb"] == 104.0 and theirs["peak_rss_mb"] == 204.0
    assert entry["ratio"] == {"decode_tok_s": pytest.approx(2.0), "ttft": 0.5, "prefill": 0.5}
    assert entry["tokens_match"] is False and entry["first_divergence"] == 2


def test_decode_rate_counts_steps_after_the_skipped_ones() -> None:
    assert decode_rate([10.0, 1.0, 1.0, 2.0]) == pytest.approx(4000.0 / 14.0)
    assert decode_rate([10.0, 1.0, 1.0, 2.0], skip=1) == pytest.approx(750.0)


def test_synthetic_prompt_is_deterministic_and_inside_the_vocabulary() -> None:
    ids = synthetic_prompt(512, 320)
    assert ids == synthetic_prompt(512, 320) and len(ids) == 512
    assert min(ids) >= 1 and max(ids) < 320 and len(set(ids)) > 100
    assert synthetic_prompt(8, 320) == ids[:8]


def test_onnxgen_engine_times_the_prefill_forward_and_one_step_per_later_token(dense_dir: Path) -> None:
    engine = OnnxgenEngine(dense_dir, threads=1)
    prompt = synthetic_prompt(6, 320)
    result = engine.run(prompt, 5)
    expected = load(dense_dir, threads=1).generate(prompt, SamplingParams(max_new_tokens=5, min_new_tokens=5))
    assert result["token_ids"] == expected.token_ids
    assert len(result["step_ms"]) == 4 and min(result["step_ms"]) > 0
    assert 0 < result["prefill_ms"] <= result["ttft_ms"]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ["--new-tokens", "4", "--decode-skip", "3"],
            "--decode-skip must be in [0, new_tokens - 1) = [0, 3) (got 3)",
        ),
        (["--runs", "0"], "--runs must be >= 1"),
        (["--threads", "0"], "--threads must be an integer >= 1"),
    ],
)
def test_bench_rejects_bad_settings_with_one_line_and_exit_2(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "some-model", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.strip().count("\n") == 0


def test_bench_refuses_prompt_plus_new_tokens_past_the_context(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "Worker", _FakeWorker)
    assert main(["bench", "m", "--prompt-tokens", "30", "--new-tokens", "16"]) == 2
    err = capsys.readouterr().err
    assert "context of 40 tokens" in err and "--prompt-tokens 30" in err


def test_bench_relays_a_worker_load_failure_as_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", str(tmp_path / "absent"), *QUICK]) == 2
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("onnxgen bench: error:"))
    assert "onnxgen worker" in line and "absent" in line
    assert "Traceback" not in err


def test_bench_compare_without_onnxruntime_genai_says_how_to_install_it(
    dense_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime_genai" else real(name, *a)
    )
    assert main(["bench", str(dense_dir), "--compare", GENAI]) == 2
    err = capsys.readouterr().err
    assert "pip install onnxruntime-genai" in err and err.strip().count("\n") == 0


@pytest.mark.skipif(not HAS_GENAI, reason="onnxruntime_genai is not installed")
def test_bench_compare_runs_both_engines_on_the_same_greedy_tokens(
    dense_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--runs", "2", "--warmups", "0", "--new-tokens", "6", "--prompt-tokens", "5", "--threads", "1"]
    assert main(["bench", str(dense_dir), *flags, "--json", "--compare", GENAI]) == 0
    [entry] = json.loads(capsys.readouterr().out)["results"]
    ours, theirs = entry["engines"]["onnxgen"], entry["engines"][GENAI]
    assert len(ours["runs"]) == len(theirs["runs"]) == 2
    assert entry["tokens_match"] is True  # end-of-sequence is masked alike on both sides
    ratio = ours["decode_tok_s"]["median"] / theirs["decode_tok_s"]["median"]
    assert entry["ratio"]["decode_tok_s"] == pytest.approx(ratio)
    assert theirs["peak_rss_mb"] > 10 and theirs["version"]


@pytest.mark.skipif(not HAS_GENAI, reason="onnxruntime_genai is not installed")
def test_genai_engine_thread_setting_changes_the_thread_pool(dense_dir: Path) -> None:
    from onnxgen.bench_genai import GenaiEngine

    keep = [GenaiEngine(dense_dir, 1)]  # first load starts onnxruntime-genai's own threads
    before = process_threads()
    keep.append(GenaiEngine(dense_dir, 1))
    one = process_threads()
    keep.append(GenaiEngine(dense_dir, 3))
    three = process_threads()
    assert before is not None and one is not None and three is not None
    assert (three - one) - (one - before) == 2  # an intra-op pool of N threads adds N - 1
