"""The decode plan `inspect` reports is the one that runs: the inline sibling takes the main session's
rewrites (fast ops, fusions, logits-to-keep), so on a builder export whose LinearAttention became Scans the
inline plan stays bit-identical to the Scan plan; warnings come once per model; the CLI has the flags."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from runtime_helpers import teacher_forced

import onnxgen
import onnxgen.llm
from onnxgen.cli import build_parser
from onnxgen.cli import main as cli_main
from onnxgen.config import EngineConfig
from onnxgen.runtime.graph_cache import SessionGraph
from onnxgen.testing import TinySpec, build_model

PROMPT = [5, 17, 200, 33, 44]
FED = [7, 9, 11, 13, 15, 17]


@pytest.fixture(scope="module")
def scan_fused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("scan-fused") / "m", "hybrid-genai-scan", TinySpec.hybrid())


def _plan_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onnxgen.runtime.decode_routing"]


def test_the_inline_plan_of_a_fast_ops_scan_hybrid_is_used_and_bit_identical_to_the_scan_plan(
    scan_fused: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        inline = onnxgen.load(scan_fused, threads=1, decode_plan="inline")
        scan = onnxgen.load(scan_fused, threads=1, decode_plan="scan")
        result = inline.generate(PROMPT, onnxgen.SamplingParams(max_new_tokens=6))
    assert inline.session.fast_ops.rewritten and scan.session.fast_ops.rewritten
    assert result.stats["decode_plan"] == "inline" and _plan_warnings(caplog) == []
    ours = teacher_forced(inline.session, inline.session.new_state(32), PROMPT, FED)
    theirs = teacher_forced(scan.session, scan.session.new_state(32), PROMPT, FED)
    np.testing.assert_array_equal(ours, theirs)
    assert inline.decode_plan.plan.sibling is not None


def test_a_sibling_without_the_main_sessions_fast_ops_is_caught_and_said_once_with_the_cli_flag(
    scan_fused: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the first-step probe sees the rounding of a sibling left without the fast ops."""

    def without_fast_ops(self: SessionGraph, graph: onnx.ModelProto, base_dir: Path) -> onnx.ModelProto:
        from onnxgen.graph.logits_to_keep import keep_last_logits

        return keep_last_logits(graph, self.io.logits).model

    monkeypatch.setattr(SessionGraph, "same_rewrites", without_fast_ops)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # two loads of one model: one warning
            llm = onnxgen.load(scan_fused, threads=1, decode_plan="inline")
            assert (
                llm.generate(PROMPT, onnxgen.SamplingParams(max_new_tokens=3)).stats["decode_plan"] == "scan"
            )
    warned = _plan_warnings(caplog)
    assert len(warned) == 1 and "differs from the Scan graph" in warned[0]
    assert "--decode-plan scan" in warned[0]


def test_inspect_reports_the_plan_the_runtime_runs(
    scan_fused: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["inspect", str(scan_fused), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    llm = onnxgen.load(scan_fused, threads=1)
    llm.generate(PROMPT, onnxgen.SamplingParams(max_new_tokens=2))
    assert info["decode_plan"] == llm.decode_plan.plan.name == "inline"
    assert info["fast_ops"] == llm.session.fast_ops.summary()


def test_asking_for_the_inline_plan_on_a_graph_without_a_scan_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = build_model(tmp_path / "dense", "genai-dense")
    with caplog.at_level(logging.WARNING):
        llm = onnxgen.load(model, threads=1, decode_plan="inline")
        onnxgen.load(model, threads=1, decode_plan="inline")
        onnxgen.load(model, threads=1)  # auto: nothing to say
    assert llm.decode_plan.plan.name == "main"
    warned = _plan_warnings(caplog)
    assert len(warned) == 1 and "no eligible Scan" in warned[0] and "--decode-plan inline" in warned[0]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"decode_plan": "auto", "fast_ops": None}),
        (["--decode-plan", "scan", "--no-fast-ops"], {"decode_plan": "scan", "fast_ops": False}),
        (["--decode-plan", "inline", "--fast-ops"], {"decode_plan": "inline", "fast_ops": True}),
    ],
)
def test_generate_chat_and_serve_pass_the_decode_plan_and_fast_ops_flags_to_load(
    scan_fused: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], expected: dict[str, Any]
) -> None:
    seen: list[EngineConfig] = []
    real = onnxgen.llm.load

    def spy(model: Any, config: EngineConfig, **kwargs: Any) -> Any:
        seen.append(config.replace(**{k: v for k, v in kwargs.items() if k in EngineConfig.fields()}))
        return real(model, config, **kwargs)

    monkeypatch.setattr(onnxgen.llm, "load", spy)
    assert cli_main(["generate", str(scan_fused), "hi", "-n", "2", "--json", *flags]) == 0
    assert {k: getattr(seen[-1], k) for k in expected} == expected
    parser = build_parser()
    for command in ("chat", "serve"):
        args = parser.parse_args([command, str(scan_fused), *flags])
        assert {k: getattr(args, k) for k in expected} == expected


def test_bench_takes_the_fast_ops_flag(scan_fused: Path) -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", str(scan_fused), "--no-fast-ops"]).fast_ops is False
    assert parser.parse_args(["bench", str(scan_fused)]).fast_ops is None
