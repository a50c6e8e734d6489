"""Decode plans: the inline sibling against the Scan plan (bit for bit), routing, hand-offs, fallbacks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from runtime_helpers import PROMPT, ids

import onnxgen
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import LLM
from onnxgen.runtime import decode_routing
from onnxgen.runtime.decode_routing import ScanSummary, choose_decode_plan
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

STEPS = 6


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("plan-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONNXGEN_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def scan_dir(family_dirs: dict[str, Path]) -> Path:
    return family_dirs["hybrid-scan"]


@pytest.fixture(scope="module")
def scan_llm(scan_dir: Path, cache_dir: Path) -> LLM:
    return onnxgen.load(scan_dir, threads=1, decode_plan="scan")


@pytest.fixture()
def inline_llm(scan_dir: Path, cache_dir: Path) -> LLM:
    return onnxgen.load(scan_dir, threads=1, decode_plan="inline")


def count_runs(
    monkeypatch: pytest.MonkeyPatch, session: ort.InferenceSession, log: list[str], tag: str
) -> None:
    """Record ``tag`` in ``log`` each time ``session`` runs a forward."""
    run = session.run_with_iobinding

    def counted(*args: object, **kwargs: object) -> object:
        log.append(tag)
        return run(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(session, "run_with_iobinding", counted)


def spy(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[str]:
    """Build the sibling now and log which session runs every later forward ("main" / "sibling")."""
    sibling = llm.decode_plan.plan.session_for(1)
    assert sibling is not llm.session.session, "the inline plan built a sibling"
    log: list[str] = []
    count_runs(monkeypatch, llm.session.session, log, "main")
    count_runs(monkeypatch, sibling, log, "sibling")
    return log


def run_steps(session: DecoderSession, state: DecodeState, chunks: list[list[int]]) -> list[np.ndarray]:
    """One forward per chunk of tokens; the logits of each."""
    return [session.forward(state, ids(chunk)) for chunk in chunks]


def continuation(llm: LLM, n: int) -> list[int]:
    state = llm.session.new_state(64)
    tokens: list[int] = []
    logits = llm.session.forward(state, ids(PROMPT))[0, -1]
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = llm.session.forward(state, ids(tokens[-1]))[0, -1]
    return tokens


def assert_same_run(a: LLM, b: LLM, chunks: list[list[int]]) -> None:
    sa, sb = a.session.new_state(64), b.session.new_state(64)
    for la, lb in zip(run_steps(a.session, sa, chunks), run_steps(b.session, sb, chunks), strict=True):
        assert np.array_equal(la, lb)
    for name, value in sa.state_arrays().items():
        assert np.array_equal(value, sb.state_arrays()[name]), name
    for name, value in sa.kv_arrays().items():
        assert np.array_equal(value, sb.kv_arrays()[name]), name


def test_inline_decode_steps_give_bit_identical_logits_and_final_states(
    scan_llm: LLM, inline_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = continuation(scan_llm, STEPS)
    log = spy(monkeypatch, inline_llm)
    assert_same_run(scan_llm, inline_llm, [PROMPT] + [[t] for t in tokens])
    assert log == ["main"] + ["sibling"] * STEPS


def test_multi_token_steps_run_on_the_main_plan_and_state_carries_across_every_hand_off(
    scan_llm: LLM, inline_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = continuation(scan_llm, 9)
    chunks = [PROMPT[:5], [tokens[0]], [tokens[1]], tokens[2:5], [tokens[5]], [tokens[6]], tokens[7:9]]
    log = spy(monkeypatch, inline_llm)
    assert_same_run(scan_llm, inline_llm, chunks)
    assert log == ["main", "sibling", "sibling", "main", "sibling", "sibling", "main"]


def test_the_sibling_keeps_the_exports_ports_in_the_same_order(inline_llm: LLM) -> None:
    sibling = inline_llm.decode_plan.plan.session_for(1)
    export = inline_llm.package.graph.graph
    assert [o.name for o in sibling.get_outputs()] == [o.name for o in export.output]
    main_inputs = [i.name for i in inline_llm.session.session.get_inputs()]
    assert [i.name for i in sibling.get_inputs()] == main_inputs
    assert main_inputs[: len(export.input)] == [i.name for i in export.input]


def test_the_scan_plan_never_builds_a_sibling(scan_llm: LLM) -> None:
    result = scan_llm.generate(PROMPT, SamplingParams(max_new_tokens=4))
    assert scan_llm.decode_plan.plan.sibling is None
    assert scan_llm.decode_plan.plan.session_for(1) is scan_llm.session.session
    assert result.stats["decode_plan"] == "scan"


def test_a_sibling_that_cannot_be_built_warns_once_and_decoding_stays_on_the_main_plan(
    scan_llm: LLM, inline_llm: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def broken(*args: object) -> ort.InferenceSession:
        calls.append(1)
        raise RuntimeError("no sibling today")

    monkeypatch.setattr(decode_routing, "build_sibling", broken)
    with caplog.at_level(logging.WARNING, logger="onnxgen.runtime.decode_routing"):
        got = inline_llm.generate(PROMPT, SamplingParams(max_new_tokens=8))
    want = scan_llm.generate(PROMPT, SamplingParams(max_new_tokens=8))
    assert got.token_ids == want.token_ids
    assert calls == [1], "a failed build is not retried"
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "no sibling today" in caplog.records[0].getMessage()
    assert got.stats["decode_plan"] == "scan"
    assert inline_llm.decode_plan.plan.session_for(1) is inline_llm.session.session


def test_generate_and_stream_report_the_plan_that_ran_the_decode_steps(inline_llm: LLM) -> None:
    assert inline_llm.generate(PROMPT, SamplingParams(max_new_tokens=3)).stats["decode_plan"] == "inline"
    last = list(inline_llm.stream(PROMPT, SamplingParams(max_new_tokens=3)))[-1]
    assert last.stats is not None and last.stats["decode_plan"] == "inline"


def test_auto_picks_inline_on_the_tiny_hybrid_and_the_tokens_match_the_scan_plan(
    scan_dir: Path, scan_llm: LLM, cache_dir: Path
) -> None:
    llm = onnxgen.load(scan_dir, threads=1)
    assert llm.decode_plan.choice.plan == "inline"
    assert "Scans" in llm.decode_plan.choice.reason
    params = SamplingParams(max_new_tokens=12)
    assert llm.generate(PROMPT, params).token_ids == scan_llm.generate(PROMPT, params).token_ids


def test_auto_keeps_the_scan_plan_where_matmuls_dwarf_the_scans() -> None:
    # The two measured models of docs/decode-plan.md: the tiny fixture and the ~60M-parameter hybrid.
    tiny = ScanSummary(("s0", "s1", "s2"), {}, 831_488)
    large = ScanSummary(tuple(f"s{i}" for i in range(6)), {}, 237_832_192)
    assert choose_decode_plan("auto", tiny).plan == "inline"
    assert choose_decode_plan("auto", large).plan == "scan"
    assert choose_decode_plan("inline", large).plan == "inline"


@pytest.mark.parametrize("requested", ["auto", "scan", "inline"])
def test_graphs_without_an_eligible_scan_run_the_main_plan_and_build_no_sibling(
    family_dirs: dict[str, Path], cache_dir: Path, requested: str
) -> None:
    llm = onnxgen.load(family_dirs["hybrid-mobius"], threads=1, decode_plan=requested)
    result = llm.generate(PROMPT, SamplingParams(max_new_tokens=3))
    assert llm.decode_plan.choice.plan == "main"
    assert llm.decode_plan.plan.sibling is None
    assert result.stats["decode_plan"] == "main"


def test_an_unusable_cache_directory_falls_back_to_the_scan_plan_with_one_warning(
    scan_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("ONNXGEN_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="onnxgen.runtime.decode_routing"):
        llm = onnxgen.load(scan_dir, threads=1, decode_plan="inline")
        result = llm.generate(PROMPT, SamplingParams(max_new_tokens=3))
    # one warning each: the plan's fallback, and the prepared graph's per-process folder
    assert [r.name for r in caplog.records].count("onnxgen.runtime.decode_routing") == 1
    assert [r.name for r in caplog.records].count("onnxgen.runtime.graph_cache") <= 1
    assert llm.decode_plan.choice.plan == "scan"
    assert result.stats["decode_plan"] == "scan"


def test_the_optimized_copy_is_made_once_and_reused(scan_dir: Path, cache_dir: Path) -> None:
    onnxgen.load(scan_dir, threads=1, decode_plan="inline")
    entries = sorted((cache_dir / "plans").iterdir())
    onnxgen.load(scan_dir, threads=1, decode_plan="inline")
    assert sorted((cache_dir / "plans").iterdir()) == entries
    assert all((e / "weights.bin").is_file() and (e / "inline.onnx").is_file() for e in entries)


def test_an_unknown_decode_plan_is_refused_with_the_choices(scan_dir: Path) -> None:
    with pytest.raises(ValueError, match="auto, scan, inline"):
        onnxgen.load(scan_dir, decode_plan="fast")


def test_a_sibling_whose_first_step_differs_from_the_scan_plan_is_not_used(
    inline_llm: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    probe = decode_routing._probe

    def skewed(main: DecoderSession, session: ort.InferenceSession, token: int) -> dict[str, np.ndarray]:
        out = probe(main, session, token)
        if session is not main.session:
            out[main.io.logits] = np.nextafter(out[main.io.logits], np.float32(np.inf))
        return out

    monkeypatch.setattr(decode_routing, "_probe", skewed)
    with caplog.at_level(logging.WARNING, logger="onnxgen.runtime.decode_routing"):
        result = inline_llm.generate(PROMPT, SamplingParams(max_new_tokens=3))
    assert result.stats["decode_plan"] == "scan"
    assert "differs from the Scan graph" in caplog.records[0].getMessage()


def _with_nan(where: str) -> Callable[..., dict[str, np.ndarray]]:
    """``decode_routing._probe`` whose outputs hold NaN in the same places for both sessions: in the logits, or in
    the first recurrent state's first row."""
    probe = decode_routing._probe

    def nan_probe(main: DecoderSession, session: ort.InferenceSession, token: int) -> dict[str, np.ndarray]:
        out = probe(main, session, token)
        name = main.io.logits if where == "logits" else main.io.state_pairs[0].output
        out[name] = out[name].copy()
        out[name].reshape(-1)[: 1 if where == "state" else None] = np.nan
        return out

    return nan_probe


def test_the_inline_check_compares_nan_as_equal_but_refuses_a_probe_whose_logits_are_not_finite(
    scan_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN the two plans share is no difference (a state slot a graph leaves unwritten); logits that are
    NaN prove nothing, so the check fails safe (the Scan plan) and says why."""
    monkeypatch.setattr(decode_routing, "_probe", _with_nan("state"))
    llm = onnxgen.load(scan_dir, threads=1)
    assert llm.decode_plan.plan.settle().plan == "inline"
    monkeypatch.setattr(decode_routing, "_probe", _with_nan("logits"))
    llm = onnxgen.load(scan_dir, threads=1)
    settled = llm.decode_plan.plan.settle()
    assert settled.plan == "scan" and "logits for token" in settled.reason and "not finite" in settled.reason
    assert llm.generate(PROMPT, SamplingParams(max_new_tokens=2)).stats["decode_plan"] == "scan"


def test_the_inline_check_feeds_a_token_from_the_middle_of_the_vocabulary(inline_llm: LLM) -> None:
    """Token 0 is often padding with a zero embedding (NaN through an L2 norm without epsilon)."""
    vocab = inline_llm.session.vocab_size
    assert decode_routing._probe_token(inline_llm.session) == vocab // 2 > 0


def test_auto_measures_its_inline_pick_and_keeps_the_faster_plan(scan_dir: Path, cache_dir: Path) -> None:
    auto = onnxgen.load(scan_dir, threads=1)  # auto: a tiny model's Scans look worth inlining
    plan = auto.decode_plan.plan
    if plan.choice.plan != "inline":
        pytest.skip(f"auto did not pick the inline plan here: {plan.choice.reason}")
    params = SamplingParams(max_new_tokens=4 * decode_routing.TRIAL_STEPS, ignore_eos=True)
    tokens = auto.generate(PROMPT, params).token_ids
    assert plan.check is not None and "against the Scan plan's" in plan.check.detail  # the trial ran
    assert plan.name in ("inline", "scan")
    scan = onnxgen.load(scan_dir, threads=1, decode_plan="scan")
    assert tokens == scan.generate(PROMPT, params).token_ids  # alternating plans changes no token


@pytest.mark.parametrize(("inline_s", "scan_s", "kept"), [(2e-3, 1e-3, "scan"), (1e-3, 2e-3, "inline")])
def test_the_trial_keeps_inline_only_where_its_steps_are_faster(
    inline_s: float, scan_s: float, kept: str
) -> None:
    choice = decode_routing.PlanChoice("auto", "inline", "the Scans look worth inlining")
    plan = decode_routing.DecodePlan(choice, Path("inline.onnx"))
    plan.sibling = object()  # type: ignore[assignment]  (built and checked: the trial may run)
    plan.check = decode_routing.InlineCheck(True, "its first step equals the Scan plan's bit for bit")
    for _ in range(decode_routing.TRIAL_STEPS - 1):
        plan.observe(0, inline_s)
        plan.observe(1, scan_s)
    assert plan.name == "inline"  # not decided before each plan ran its steps
    plan.observe(0, inline_s)
    plan.observe(1, scan_s)
    assert plan.name == kept
    requested = decode_routing.DecodePlan(decode_routing.PlanChoice("inline", "inline", "asked"), Path("x"))
    assert requested._trial is None  # an explicit decode_plan='inline' is not second-guessed
