"""The state_window verify variant of fused exports (CUDA-only in onnxruntime 1.32)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from onnxgen.graph.fused_state_window import emit_fused_state_window
from onnxgen.model import ModelPackage
from onnxgen.testing import TinySpec, build_model


@pytest.fixture(scope="module", params=["hybrid-genai", "hybrid-mobius"])
def fused_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp(request.param), request.param, TinySpec.hybrid())


def _pairs(model_dir: Path) -> list[tuple[str, str]]:
    return [(p.input, p.output) for p in ModelPackage.open(model_dir).io.state_pairs]


def _load(model_dir: Path) -> onnx.ModelProto:
    return onnx.load(str(model_dir / "model.onnx"), load_external_data=False)


def test_the_state_window_variant_keeps_the_graph_ports_and_adds_w_row_outputs(fused_dir: Path) -> None:
    model = _load(fused_dir)
    done = emit_fused_state_window(model, _pairs(fused_dir), window=6)
    out, result = done.model, done.report
    assert not result.skipped and len(result.per_position) == 6
    assert [i.name for i in out.graph.input] == [i.name for i in model.graph.input]
    assert [i.type for i in out.graph.input] == [i.type for i in model.graph.input]
    names = [o.name for o in out.graph.output]
    assert names[: len(model.graph.output)] == [o.name for o in model.graph.output]
    producers = {o: n for n in out.graph.node for o in n.output}
    for p in result.per_position:
        assert p.layout == "rows"
        op = producers[p.output]
        assert op.op_type in ("LinearAttention", "CausalConvWithState")
        assert helper.get_attribute_value(next(a for a in op.attribute if a.name == "state_window")) == 6
        assert producers[op.input[3]].op_type == "Expand"
        assert producers[p.state_output].op_type == "Gather"
        rows = next(o for o in out.graph.output if o.name == p.output).type.tensor_type.shape.dim
        assert rows[0].dim_value == 6
    assert not any(a.name == "state_window" for n in model.graph.node for a in n.attribute), (
        "the input model must not change"
    )


def test_onnxruntime_cpu_still_refuses_state_window_so_cpu_sessions_capture_instead(fused_dir: Path) -> None:
    # If this starts passing a session, the CPU kernels gained state_window: state_commit.plan_graph can
    # then use the state_window variant on CPU too (docs/speculative-commit.md).
    done = emit_fused_state_window(_load(fused_dir), _pairs(fused_dir), window=4)
    out, _ = done.model, done.report
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(fused_dir))
    opts.log_severity_level = 4
    with pytest.raises(Exception, match="state_window"):
        ort.InferenceSession(out.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_a_state_window_outside_the_ops_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        emit_fused_state_window(onnx.ModelProto(), [], window=9)
