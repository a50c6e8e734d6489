"""``onnxgen bench``: JSON/table reports from real worker processes, interleaving and statistics with
fake workers, decode plans side by side, speculative vs plain decoding, the built-in prompts, the
onnxruntime-genai side (when installed) and the errors."""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from onnxgen.bench import harness as bench
from onnxgen.bench.genai_engine import BenchError
from onnxgen.bench.harness import BenchConfig, decode_rate, run_bench, synthetic_prompt
from onnxgen.bench.onnxgen_engine import OnnxgenEngine
from onnxgen.bench.prompts import CODE_SNIPPET, novel_prompt, repetitive_prompt
from onnxgen.bench.stats import ratio
from onnxgen.bench.worker import peak_rss_mb, process_threads, rss_mb
from onnxgen.cli import main
from onnxgen.cli.bench_table import format_report
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative.proposers import NgramProposer
from onnxgen.graph.decode_fusions import planned_fusions
from onnxgen.llm import load
from onnxgen.testing import build_model
from onnxgen.tokenizer import Tokenizer

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
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("bench-hybrid"), "hybrid-genai")


@pytest.fixture(scope="module")
def hybrid_report(hybrid_dir: Path) -> dict[str, Any]:
    cfg = BenchConfig(str(hybrid_dir), prompt_tokens=(4,), new_tokens=4, warmups=0, runs=1, threads=1)
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
    assert (
        entry["prompt_tokens"] == 4
        and entry["prompt"] == "synthetic"
        and set(entry["engines"]) == {"onnxgen"}
    )
    e = entry["engines"]["onnxgen"]
    for key in ("prefill_ms", "ttft_ms", "decode_tok_s", "decode_ms_per_token", "total_ms"):
        assert set(e[key]) == {"median", "min", "max"} and e[key]["median"] > 0
    assert e["prefill_ms"]["median"] <= e["ttft_ms"]["median"] <= e["total_ms"]["median"]
    assert e["decode_ms_per_token"]["median"] == pytest.approx(1000.0 / e["decode_tok_s"]["median"])
    assert len(e["runs"]) == 1
    assert e["peak_rss_mb"] > 10  # onnxruntime alone takes more than this
    assert e["pss_mb"] is None or 10 < e["pss_mb"] <= e["peak_rss_mb"] + 1
    assert e["load_s"] > 0 and 10 < e["rss_load_mb"] <= e["peak_load_mb"] <= e["peak_rss_mb"]
    assert 10 < e["rss_mb"] <= e["peak_rss_mb"]
    assert e["process_threads"] >= 1
    assert e["fast_ops"] == "off: not a hybrid on onnxruntime's CPU provider"
    graph = onnx.load(str(Path(report["model"]) / "model.onnx"), load_external_data=False)
    assert e["decode_fusions"] == planned_fusions(graph).summary()
    assert (e["decode_plan_requested"], e["decode_plan"]) == ("auto", "main")
    assert "no Scan" in e["decode_plan_reason"]


def test_bench_table_has_one_row_per_engine_and_prompt_length_and_states_the_machine(
    hybrid_report: dict[str, Any],
) -> None:
    text = format_report(hybrid_report)
    assert "machine: " in text and "cores available" in text and "1 intra-op threads" in text
    assert (
        "decode plan: main (no eligible Scan (the graph has no Scan))" in text
    )  # said without --decode-plan
    e = hybrid_report["results"][0]["engines"]["onnxgen"]
    graph = onnx.load(str(Path(hybrid_report["model"]) / "model.onnx"), load_external_data=False)
    fused = sum(n.op_type in ("GatedRMSNorm", "CausalConvWithState") for n in graph.graph.node)
    assert fused >= 2 and e["fast_ops"] == f"{fused} hybrid ops on vectorized kernels"
    assert f"fast ops: {fused} hybrid ops on vectorized kernels" in text
    assert f"fusions: {planned_fusions(graph).summary()}" in text
    row = next(
        line.split() for line in text.splitlines() if line.split()[:3] == ["synthetic", "4", "onnxgen"]
    )
    assert f"{e['decode_tok_s']['median']:.1f}" in row
    assert f"{e['decode_ms_per_token']['median']:.3f}" in row


class _FakeWorker:
    """Stands in for a worker process: records the order of runs, returns scripted timings."""

    order: list[str] = []  # noqa: RUF012 (shared log of one test)
    started: list[dict[str, Any]] = []  # noqa: RUF012

    def __init__(
        self,
        engine: str,
        model: str,
        threads: int,
        options: dict[str, Any] | None = None,
        label: str | None = None,
    ) -> None:
        self.engine = engine
        self.label = label or engine
        self.calls = 0
        self.options = options or {}
        self.started.append({"label": self.label, **self.options})
        self.info = {"vocab_size": 50, "context_length": 40, "version": "t", "process_threads": 2 + threads}

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        assert list(prompt) == synthetic_prompt(len(prompt), 50)
        self.calls += 1
        self.order.append(self.label)
        slow = 2.0 if self.engine == GENAI else 1.0
        return {
            "prefill_ms": 10.0 * self.calls * slow,
            "ttft_ms": 11.0 * self.calls * slow,
            "step_ms": [100.0] + [self.calls * slow] * (new_tokens - 2),  # a slow first decode step
            "token_ids": [7] * new_tokens if self.engine == "onnxgen" else [7, 7, 8] + [7] * (new_tokens - 3),
            "peak_rss_mb": 100.0 * slow + self.calls,
            **self._plan(),
        }

    @staticmethod
    def variant_run(
        step_ms: list[float], total_ms: float, token_ids: list[int], **stats: Any
    ) -> dict[str, Any]:
        """A speculative or constrained run's reply: fixed prefill, TTFT and RSS, then these timings and stats."""
        return {
            "prefill_ms": 5.0,
            "ttft_ms": 6.0,
            "step_ms": step_ms,
            "total_ms": total_ms,
            "token_ids": token_ids,
            "peak_rss_mb": 150.0,
            **stats,
        }

    def _plan(self) -> dict[str, str]:
        if self.engine != "onnxgen":
            return {}
        plan = self.options.get("decode_plan", "auto")
        return {"decode_plan_requested": plan, "decode_plan": plan, "decode_plan_reason": f"asked for {plan}"}

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


def test_bench_processes_starts_fresh_workers_in_turn_and_pools_their_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each worker set is started, warmed up, run and closed before the next; the medians are over every
    set's runs, and each set's own decode-rate ratio is kept (one process can be luckier than another)."""
    monkeypatch.setattr(bench, "require_genai", lambda: None)
    monkeypatch.setattr(bench, "Worker", _FakeWorker)
    _FakeWorker.order, _FakeWorker.started = [], []
    cfg = BenchConfig(
        "m", prompt_tokens=(5,), new_tokens=6, warmups=1, runs=2, threads=2, compare=GENAI, processes=3
    )
    report = run_bench(cfg, log=lambda _: None)
    [entry] = report["results"]
    assert report["processes"] == 3
    assert [w["label"] for w in _FakeWorker.started] == ["onnxgen", GENAI] * 3
    assert _FakeWorker.order == ["onnxgen", GENAI] * 9  # 3 runs (1 warmup) per set, interleaved
    ours, theirs = entry["engines"]["onnxgen"], entry["engines"][GENAI]
    assert len(ours["runs"]) == len(theirs["runs"]) == 6
    # every fresh worker counts its calls from 1: measured calls 2 and 3 of each set, pooled
    assert sorted(r["prefill_ms"] for r in ours["runs"]) == [20.0, 20.0, 20.0, 30.0, 30.0, 30.0]

    # each set's paired decode-rate ratio (steps include the slow first one here)
    def rate(step: float) -> float:
        return decode_rate([100.0] + [step] * 4)

    one = (rate(2.0) / rate(4.0) + rate(3.0) / rate(6.0)) / 2  # the median of the set's two run pairs
    assert entry["process_decode_ratios"] == {"onnxgen": [pytest.approx(one)] * 3}
    text = format_report(report)
    assert "medians of 6 runs (2 in each of 3 worker sets), each set after 1 warmup(s)" in text
    assert "decode tok/s onnxgen/genai of each of the 3 worker sets (pooled above):" in text
    assert f"synthetic/5 onnxgen: {one:.2f}x {one:.2f}x {one:.2f}x" in text


def test_engine_ratios_are_medians_of_run_pairs_so_drift_between_pairs_cancels() -> None:
    def engine(rates: list[float]) -> dict[str, Any]:
        return {"runs": [{"decode_tok_s": r, "ttft_ms": 1000 / r, "prefill_ms": 500 / r} for r in rates]}

    # the machine slows down between pairs 1 and 2; within each pair onnxgen is ahead but in the last
    ours, theirs = engine([100.0, 300.0, 310.0]), engine([95.0, 280.0, 350.0])
    r = ratio(ours, theirs)
    assert r["decode_tok_s"] == pytest.approx(100.0 / 95.0)  # the pairs: 1.053, 1.071, 0.886
    assert r["ttft"] == pytest.approx(95.0 / 100.0) and r["prefill"] == pytest.approx(95.0 / 100.0)
    # (the ratio of the two medians, 300 / 280 = 1.071, would compare runs made minutes apart)


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
        (["--processes", "0"], "--processes must be >= 1 (got 0)"),
        (["--threads", "0"], "--threads must be an integer >= 1"),
        (
            ["--decode-plan", "scan,fast"],
            "--decode-plan 'scan,fast': each entry must be one of auto, scan, inline",
        ),
        (["--decode-plan", "scan,scan"], "listed once"),
        (["--prompt-kind", "poetry"], "--prompt-kind 'poetry': each entry must be one of synthetic"),
        (["--speculative", "ngram"], "--speculative 'ngram' is not a mode"),
        (["--draft-tokens", "2"], "--draft-tokens 2 needs --speculative"),
        (["--prompt-file", "/no/such/prompt.txt"], "--prompt-file '/no/such/prompt.txt' cannot be read"),
    ],
)
def test_bench_rejects_bad_settings_with_one_line_and_exit_2(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "some-model", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.strip().count("\n") == 0


def test_bench_refuses_prompt_plus_new_tokens_past_the_context(
    dense_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "Worker", _FakeWorker)
    assert main(["bench", str(dense_dir), "--prompt-tokens", "30", "--new-tokens", "16"]) == 2
    err = capsys.readouterr().err
    assert "prompt synthetic of 30 tokens plus --new-tokens 16" in err and "context of 40 tokens" in err


def test_bench_checks_every_prompt_against_the_context_before_timing_any(
    dense_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `onnxgen bench MODEL --prompt-tokens 5,30 --new-tokens 16` on a 40-token model: 5 + 16 fits, 30 + 16
    # does not
    monkeypatch.setattr(bench, "Worker", _FakeWorker)
    _FakeWorker.order = []
    m = str(dense_dir)
    assert main(["bench", m, "--prompt-tokens", "5,30", "--new-tokens", "16"]) == 2
    assert "prompt synthetic of 30 tokens plus --new-tokens 16" in capsys.readouterr().err
    assert _FakeWorker.order == []  # nothing was timed and thrown away
    assert main(["bench", m, "--prompt-tokens", "5,20", "--new-tokens", "16", "--runs", "1"]) == 0
    assert _FakeWorker.order  # the control: prompts that fit are timed


def test_peak_rss_is_never_below_the_resident_size_now() -> None:
    held = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB touched: resident now
    now, peak = rss_mb(), peak_rss_mb()
    assert now is not None and peak is not None and peak >= now > 64
    del held


def test_bench_relays_a_worker_load_failure_as_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "absent").mkdir()  # a folder without a model: found, and the worker's load fails
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
    pairs = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(ours["runs"], theirs["runs"], strict=True)]
    assert entry["ratio"]["decode_tok_s"] == pytest.approx(statistics.median(pairs))
    assert theirs["peak_rss_mb"] > 10 and theirs["version"]
    memory = entry["memory_ratios"]["onnxgen"]
    assert memory["rss_load"] == pytest.approx(ours["rss_load_mb"] / theirs["rss_load_mb"])
    assert memory["load_s"] == pytest.approx(ours["load_s"] / theirs["load_s"])
    assert all(v > 0 for v in memory.values())


def test_the_genai_worker_imports_nothing_of_onnxgens_engine() -> None:
    """Its memory is what an onnxruntime-genai user's process holds, not onnx's and onnxgen's too."""
    import subprocess
    import sys

    from onnxgen.bench.worker import WORKER_CODE

    code = (
        WORKER_CODE[GENAI].split(";")[0]
        + "; import sys; print(sorted({'onnx', 'onnxgen.llm', 'onnxruntime'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(not HAS_GENAI, reason="onnxruntime_genai is not installed")
def test_genai_engine_thread_setting_changes_the_thread_pool(dense_dir: Path) -> None:
    from onnxgen.bench.genai_engine import GenaiEngine

    keep = [GenaiEngine(dense_dir, 1)]  # first load starts onnxruntime-genai's own threads
    before = process_threads()
    keep.append(GenaiEngine(dense_dir, 1))
    one = process_threads()
    keep.append(GenaiEngine(dense_dir, 3))
    three = process_threads()
    assert before is not None and one is not None and three is not None
    assert (three - one) - (one - before) == 2  # an intra-op pool of N threads adds N - 1


# -- decode plans ---------------------------------------------------------------------------------
def test_bench_runs_one_worker_per_decode_plan_interleaved_and_names_the_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "require_genai", lambda: None)
    monkeypatch.setattr(bench, "Worker", _FakeWorker)
    _FakeWorker.order, _FakeWorker.started = [], []
    cfg = BenchConfig(
        "m",
        prompt_tokens=(5,),
        new_tokens=6,
        warmups=1,
        runs=2,
        decode_plans=("scan", "inline"),
        compare=GENAI,
    )
    report = run_bench(cfg, log=lambda _: None)
    assert [w["label"] for w in _FakeWorker.started] == ["onnxgen[scan]", "onnxgen[inline]", GENAI]
    assert [w.get("decode_plan") for w in _FakeWorker.started] == ["scan", "inline", None]
    assert _FakeWorker.order == ["onnxgen[scan]", "onnxgen[inline]", GENAI] * 3
    [entry] = report["results"]
    assert entry["engines"]["onnxgen[inline]"]["decode_plan"] == "inline"
    assert entry["engines"]["onnxgen[scan]"]["decode_plan_reason"] == "asked for scan"
    assert set(entry["ratios"]) == {"onnxgen[scan]", "onnxgen[inline]"}
    assert entry["ratio"] == entry["ratios"]["onnxgen[scan]"]
    assert entry["tokens_match"] is False and entry["diverging_engines"] == [GENAI]  # the plans agree
    text = format_report(report)
    assert "decode plans (asked -> ran: why):" in text
    assert "  onnxgen[inline]: inline -> inline: asked for inline" in text
    assert any(line.split()[0] == "onnxgen[inline]/genai" for line in text.splitlines() if line.strip())


def test_bench_decode_plans_scan_and_inline_side_by_side_on_a_scan_hybrid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ONNXGEN_CACHE_DIR", str(tmp_path / "cache"))  # the workers' optimized copies
    model = build_model(tmp_path / "scan", "hybrid-scan")
    flags = ["--decode-plan", "scan,inline", "--warmups", "1", *QUICK]
    assert main(["bench", str(model), *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["decode_plans"] == ["scan", "inline"]
    [entry] = report["results"]
    assert list(entry["engines"]) == ["onnxgen[scan]", "onnxgen[inline]"]
    for plan in ("scan", "inline"):
        e = entry["engines"][f"onnxgen[{plan}]"]
        assert (e["decode_plan_requested"], e["decode_plan"]) == (plan, plan)  # ran as asked, after warmup
        assert e["decode_plan_reason"] == f"decode_plan={plan!r} was requested"
        assert e["decode_ms_per_token"]["median"] > 0 and e["peak_rss_mb"] > 10
        if Path("/proc/self/smaps_rollup").is_file():
            assert e["pss_mb"] > 10
    assert entry["tokens_match"] is True  # both plans pick the same greedy tokens
    assert any((tmp_path / "cache" / "plans").iterdir())  # the inline worker built its copy there


# -- constrained decoding -------------------------------------------------------------------------
class _ConstrainingWorker(_FakeWorker):
    """Plain decode steps take 2 ms, constrained ones ``SLOWER[name]`` times that, with 100 us a token
    in the constraint."""

    SLOWER = {"json_schema": 1.25, "regex": 2.0}  # noqa: RUF012

    def run(
        self, prompt: Sequence[int], new_tokens: int, speculative: bool = False, constraint: str | None = None
    ) -> dict[str, Any]:
        assert not speculative
        if constraint is None:
            return {**super().run(prompt, new_tokens), "step_ms": [100.0] + [2.0] * (new_tokens - 2)}
        self.order.append(f"{self.label}+{constraint}")
        step = 2.0 * self.SLOWER[constraint]
        return self.variant_run(
            [100.0] + [step] * (new_tokens - 2),
            50.0,
            [3] * new_tokens,
            constraint_s=1e-4 * new_tokens,
            constraint_masks=new_tokens,
        )


def test_bench_constraints_alternate_with_plain_runs_and_report_the_paired_slowdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "Worker", _ConstrainingWorker)
    _FakeWorker.order, _FakeWorker.started = [], []
    cfg = BenchConfig(
        "m",
        prompt_tokens=(5,),
        new_tokens=8,
        warmups=0,
        runs=3,
        decode_skip=1,
        constraints=("json_schema", "regex"),
    )
    report = run_bench(cfg, log=lambda _: None)
    p, j, r = "onnxgen", "onnxgen+json_schema", "onnxgen+regex"
    assert _FakeWorker.order == [p, j, r, j, r, p, r, p, j]  # rotated: no variant always runs first
    assert report["constraints"] == ["json_schema", "regex"]
    c = report["results"][0]["engines"]["onnxgen"]["constraints"]
    assert c["json_schema"]["slowdown"] == pytest.approx(0.25) and c["regex"]["slowdown"] == pytest.approx(
        1.0
    )
    assert c["json_schema"]["constraint_us_per_token"]["median"] == pytest.approx(100.0)
    assert c["json_schema"]["constraint_masks"] == 8
    row = next(ln.split() for ln in format_report(report).splitlines() if "regex" in ln and "%" in ln)
    assert row[:4] == ["synthetic", "5", "onnxgen", "regex"] and "+100.0%" in row


def test_bench_constraint_flags_are_checked_before_any_worker_starts() -> None:
    with pytest.raises(ValueError, match="unknown constraint 'yaml'"):
        BenchConfig("m", constraints=("yaml",))
    with pytest.raises(ValueError, match="listed twice"):
        BenchConfig("m", constraints=("regex", "regex"))
    with pytest.raises(ValueError, match="give one of them"):
        BenchConfig("m", constraints=("regex",), speculative="prompt-lookup")


def test_bench_constraints_on_a_tiny_hybrid_mask_every_token(
    hybrid_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--constraint", "json_schema,grammar", "--runs", "1", "--warmups", "0", "--threads", "1"]
    assert (
        main(["bench", str(hybrid_dir), *flags, "--json", "--prompt-tokens", "8", "--new-tokens", "12"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    constraints = report["results"][0]["engines"]["onnxgen"]["constraints"]
    assert set(constraints) == {"json_schema", "grammar"}
    for c in constraints.values():
        # each token took a mask or was an argmax the grammar allowed; the run never ended early
        assert c["constraint_masks"] + c["constraint_unmasked"] == 12
        assert c["unmasked_share"] == c["constraint_unmasked"] / 12
        assert c["constraint_us_per_token"]["median"] > 0 and 0 < c["constraint_share"] < 1


# -- speculative decoding -------------------------------------------------------------------------
class _SpeculatingWorker(_FakeWorker):
    """Plain runs end-to-end in PLAIN_MS[i] ms, speculative ones in SPEC_MS[i] (i counts warmups too);
    the speculative tokens differ from token 3 on in the last run."""

    PLAIN_MS = (999.0, 100.0, 300.0, 90.0)
    SPEC_MS = (1.0, 25.0, 60.0, 90.0)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec_calls = 0

    def run(self, prompt: Sequence[int], new_tokens: int, speculative: bool = False) -> dict[str, Any]:
        if not speculative:
            result = super().run(prompt, new_tokens)
            return {**result, "total_ms": self.PLAIN_MS[self.calls - 1], "forward_passes": new_tokens}
        self.spec_calls += 1
        self.order.append(f"{self.label}+spec")
        ids = [7] * new_tokens if self.spec_calls < 4 else [7, 7, 7, 9] + [7] * (new_tokens - 4)
        return self.variant_run(
            [0.5] * (new_tokens - 1),
            self.SPEC_MS[self.spec_calls - 1],
            ids,
            forward_passes=4,
            proposed_draft_tokens=10,
            accepted_draft_tokens=6,
            target_forward_passes=4,
            state_replays=1,
        )


def test_bench_speculative_alternates_with_plain_runs_and_reports_the_paired_speedup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "Worker", _SpeculatingWorker)
    _FakeWorker.order, _FakeWorker.started = [], []
    cfg = BenchConfig(
        "m",
        prompt_tokens=(5,),
        new_tokens=8,
        warmups=1,
        runs=3,
        speculative="prompt-lookup",
        prompt_kinds=("synthetic",),
    )
    report = run_bench(cfg, log=lambda _: None)
    assert _FakeWorker.started[0]["speculative"] == {
        "mode": "prompt-lookup",
        "draft_tokens": 4,
        "draft_path": None,
    }
    plain, spec = "onnxgen", "onnxgen+spec"
    assert _FakeWorker.order == [plain, spec, spec, plain, plain, spec, spec, plain]
    assert report["speculative"] == "prompt-lookup" and report["draft_tokens"] == 4
    s = report["results"][0]["engines"]["onnxgen"]["speculative"]
    # measured pairs: 100/25 = 4, 300/60 = 5, 90/90 = 1 -> median 4 (the ratio of medians would be 1.67)
    assert s["speedup"] == 4.0
    assert s["total_ms"]["median"] == 60.0 and s["plain_total_ms"]["median"] == 100.0
    assert s["tokens_per_target_forward"] == 2.0 and s["plain_tokens_per_forward"] == 1.0
    assert s["decode_tok_s"]["median"] == 2000.0
    assert (s["accepted_draft_tokens"], s["proposed_draft_tokens"], s["acceptance"]) == (6, 10, 0.6)
    assert s["tokens_match"] is False and s["first_divergence"] == 3
    row = next(ln.split() for ln in format_report(report).splitlines() if "6/10" in ln)
    assert row[:3] == ["synthetic", "5", "onnxgen"] and "4.00x" in row and "2.00" in row
    assert row[-3:] == ["no", "(from", "3)"]


def test_bench_speculative_json_on_a_tiny_hybrid_has_every_key_and_the_plain_tokens(
    hybrid_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--speculative", "prompt-lookup", "--runs", "1", "--warmups", "0", "--threads", "1", "--json"]
    assert main(["bench", str(hybrid_dir), *flags, "--prompt-tokens", "40", "--new-tokens", "12"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(e["prompt"], e["prompt_tokens"]) for e in report["results"]] == [
        ("repetitive", 40),
        ("novel", 40),
    ]
    for entry in report["results"]:
        s = entry["engines"]["onnxgen"]["speculative"]
        assert s["mode"] == "prompt-lookup" and s["draft_tokens"] == 4
        assert s["tokens_match"] is True and s["first_divergence"] is None
        assert 0 <= s["accepted_draft_tokens"] <= s["proposed_draft_tokens"]
        assert s["tokens_per_target_forward"] == pytest.approx(12 / s["target_forward_passes"])
        assert s["plain_tokens_per_forward"] == 1.0
        for key in (
            "total_ms",
            "plain_total_ms",
            "decode_tok_s",
            "plain_decode_tok_s",
            "prefill_ms",
            "ttft_ms",
        ):
            assert s[key]["median"] > 0
        assert s["speedup"] == pytest.approx(s["plain_total_ms"]["median"] / s["total_ms"]["median"])


def test_bench_speculative_with_a_draft_model_directory(
    dense_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [
        "--speculative",
        f"draft:{dense_dir}",
        "--draft-tokens",
        "3",
        "--prompt-kind",
        "novel",
        "--prompt-tokens",
        "20",
    ]
    assert (
        main(
            ["bench", str(dense_dir), *flags, "--runs", "1", "--warmups", "0", "--new-tokens", "10", "--json"]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    s = report["results"][0]["engines"]["onnxgen"]["speculative"]
    assert s["mode"] == f"draft:{dense_dir}" and s["draft_tokens"] == 3
    assert s["tokens_match"] is True and s["accepted_draft_tokens"] > 0  # the model drafting for itself


# -- prompts --------------------------------------------------------------------------------------
def _longest_repeat(ids: Sequence[int]) -> int:
    """The longest span of ids that occurs at two positions."""
    best = 0
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            k = 0
            while j + k < len(ids) and ids[i + k] == ids[j + k]:
                k += 1
            best = max(best, k)
    return best


@pytest.fixture(scope="module")
def encode(dense_dir: Path) -> Any:
    tok = Tokenizer.from_dir(dense_dir)
    return lambda text, special: tok.encode(text, add_special_tokens=special)


def _drafted_tokens_per_forward(context: list[int], continuation: list[int]) -> float:
    """Tokens per target forward if a model generated ``continuation`` after ``context`` and prompt lookup
    drafted for it (greedy acceptance: the longest matching prefix of each draft, plus one token)."""
    proposer = NgramProposer(max_ngram=3, min_ngram=1)
    done = forwards = 0
    while done < len(continuation):
        drafts, _ = proposer.propose(np.array(context + continuation[:done]), 4)
        j = 0
        while j < len(drafts) and done + j < len(continuation) and drafts[j] == continuation[done + j]:
            j += 1
        done, forwards = done + j + 1, forwards + 1
    return len(continuation) / forwards


@pytest.mark.parametrize("length", [16, 64, 200])
def test_the_repetitive_prompt_has_the_asked_length_and_ends_inside_a_copy_of_its_snippet(
    length: int, encode: Any
) -> None:
    ids = repetitive_prompt(length, encode)
    assert len(ids) == length
    code = encode(CODE_SNIPPET, False)
    copied = max(
        m for m in range(1, length) if ids[-m:] == code[:m]
    )  # the prompt ends in the snippet's start
    assert copied >= 2
    starts = [i for i in range(length - copied + 1) if ids[i : i + copied] == code[:copied]]
    assert len(starts) == 3  # the body twice, then its beginning again
    assert _longest_repeat(ids) >= length // 3


@pytest.mark.parametrize("length", [64, 200])
def test_prompt_lookup_drafts_the_repetitive_prompts_continuation_but_not_the_novel_ones(
    length: int, encode: Any
) -> None:
    ids = repetitive_prompt(length, encode)
    code = encode(CODE_SNIPPET, False)
    copied = max(m for m in range(1, length) if ids[-m:] == code[:m])
    assert _drafted_tokens_per_forward(ids, code[copied : copied + 12]) >= 2.5
    novel = novel_prompt(length + 12, encode)
    assert _drafted_tokens_per_forward(novel[:length], novel[length:]) < 1.3


def test_the_novel_prompt_has_nothing_long_to_copy(encode: Any) -> None:
    ids = novel_prompt(200, encode)
    assert len(ids) == 200 and ids == novel_prompt(250, encode)[:200]
    assert _longest_repeat(ids) <= 6


def test_built_in_prompts_longer_than_their_text_are_refused_with_the_fix(encode: Any) -> None:
    with pytest.raises(
        BenchError, match=r"--prompt-kind repetitive .* change --prompt-tokens or give a --prompt-file"
    ):
        repetitive_prompt(100_000, encode)
    with pytest.raises(BenchError, match=r"--prompt-kind novel has \d+ tokens"):
        novel_prompt(100_000, encode)


class _EncodingWorker(_FakeWorker):
    def encode(self, text: str, special: bool = True) -> list[int]:
        return [1 + ord(c) % 40 for c in text]

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        self.order.append(",".join(map(str, prompt)))
        return {**super().run(synthetic_prompt(len(prompt), 50), new_tokens)}


def test_bench_prompt_file_is_encoded_by_the_worker_and_used_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "Worker", _EncodingWorker)
    _FakeWorker.order = []
    path = tmp_path / "prompt.txt"
    path.write_text("hello", encoding="utf-8")
    cfg = BenchConfig("m", prompt_tokens=(3,), new_tokens=4, warmups=0, runs=1, prompt_files=(str(path),))
    [entry] = run_bench(cfg, log=lambda _: None)["results"]
    assert (entry["prompt"], entry["prompt_tokens"]) == ("prompt.txt", 5)
    assert _FakeWorker.order[0] == ",".join(str(1 + ord(c) % 40) for c in "hello")
