"""The fused exports' verify variants: captured state-op inputs + commit graph (CPU), state_window (CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_scan_state_window import DRAFT, PROMPT, Runner

from onnxgen.graph.fused_state_capture import capture_fused_inputs, commit_graph, conv_state_after
from onnxgen.graph.fused_state_window import emit_fused_state_window
from onnxgen.model import ModelPackage
from onnxgen.testing import TinySpec, build_model

ELEM = {"tensor(float)": TensorProto.FLOAT}


@pytest.fixture(scope="module", params=["hybrid-genai", "hybrid-mobius"])
def fused_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp(request.param), request.param, TinySpec.hybrid())


def _pairs(model_dir: Path) -> list[tuple[str, str]]:
    return [(p.input, p.output) for p in ModelPackage.open(model_dir).io.state_pairs]


def _load(model_dir: Path) -> onnx.ModelProto:
    return onnx.load(str(model_dir / "model.onnx"), load_external_data=False)


def test_replaying_the_captured_inputs_gives_the_states_of_fresh_runs_over_each_prefix_bit_for_bit(
    fused_dir: Path,
) -> None:
    model = _load(fused_dir)
    out, result = capture_fused_inputs(model, _pairs(fused_dir))
    assert not result.skipped and len(result.captured) == 6
    run = Runner(fused_dir, out)
    ports = {
        p.name: (ELEM[p.type], p.shape)
        for p in (*run.sess.get_inputs(), *run.sess.get_outputs())
        if p.type in ELEM
    }
    commit = ort.InferenceSession(
        commit_graph(result.captured, ports, 21).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    before = run.pasts_after(run.run(run.empty(), PROMPT))
    verify = run.run(before, DRAFT)
    recurrent = next(op.state_output for op in result.captured if op.op_type == "LinearAttention")
    by_prefix = []
    for kept in range(1, len(DRAFT) + 1):
        fresh = run.run(before, DRAFT[:kept])
        feeds = {}
        for op in result.captured:
            if op.op_type == "LinearAttention":
                feeds[op.state_input] = before[op.state_input]
                feeds.update({n: verify[n][:, :kept] for n in op.captures.values()})
        got = dict(zip([o.name for o in commit.get_outputs()], commit.run(None, feeds), strict=True))
        for op in result.captured:
            if op.op_type == "CausalConvWithState":
                got[op.state_output] = np.empty_like(before[op.state_input])
                conv_state_after(
                    before[op.state_input], verify[op.captures[0]], kept, 2, got[op.state_output]
                )
            assert np.array_equal(got[op.state_output], fresh[op.state_output]), f"{op.state_output} @ {kept}"
        by_prefix.append(got[recurrent])
    assert not np.array_equal(by_prefix[0], by_prefix[-1]), "the states after different prefixes must differ"


def test_the_capture_graph_answers_ordinary_forwards_bit_identically(fused_dir: Path) -> None:
    model = _load(fused_dir)
    out, _ = capture_fused_inputs(model, _pairs(fused_dir))
    plain, rewritten = Runner(fused_dir, model), Runner(fused_dir, out)
    a, b = plain.run(plain.empty(), PROMPT), rewritten.run(rewritten.empty(), PROMPT)
    assert set(a) < set(b)
    for name, value in a.items():
        assert np.array_equal(value, b[name]), name


@pytest.mark.parametrize("kept", [1, 2, 3, 4, 6])
def test_the_conv_state_after_a_prefix_is_the_last_columns_of_past_and_kept_inputs(kept: int) -> None:
    past = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    x = 100 + np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    out = np.full_like(past, -1)
    conv_state_after(past, x, kept, 2, out)
    joined = [*past.transpose(2, 0, 1), *x[:, :, :kept].transpose(2, 0, 1)]  # columns in time order
    assert np.array_equal(out, np.stack(joined[-3:], axis=2))


def test_the_state_window_variant_keeps_the_graph_ports_and_adds_w_row_outputs(fused_dir: Path) -> None:
    model = _load(fused_dir)
    out, result = emit_fused_state_window(model, _pairs(fused_dir), window=6)
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
    # If this starts passing a session, the CPU kernels gained state_window: verify_plan.plan_graph can
    # then use the state_window variant on CPU too (docs/speculative-commit.md).
    out, _ = emit_fused_state_window(_load(fused_dir), _pairs(fused_dir), window=4)
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(fused_dir))
    opts.log_severity_level = 4
    with pytest.raises(Exception, match="state_window"):
        ort.InferenceSession(out.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_a_state_window_outside_the_ops_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        emit_fused_state_window(onnx.ModelProto(), [], window=9)
