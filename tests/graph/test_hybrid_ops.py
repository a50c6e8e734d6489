"""The fast-ops pass: GatedRMSNorm and SiLU-fused CausalConvWithState on vectorized kernels."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgen
from onnxgen.graph.hybrid_ops import rewrite_hybrid_ops
from onnxgen.model import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import TinySpec, build_model, reference_logits
from onnxgen.testing.spec import make_weights

MS = "com.microsoft"


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts).run(None, feeds)


def _model(nodes: list[onnx.NodeProto], inputs, outputs, inits, dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, dtype, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, dtype, None) for n in outputs],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)], ir_version=10
    )


def _gated_norm(activation: str | None, heads: int = 3, width: int = 16, dtype=np.float32) -> onnx.ModelProto:
    attrs = {"epsilon": 1e-6} | ({"activation": activation} if activation else {})
    node = helper.make_node("GatedRMSNorm", ["x", "scale", "z"], ["y"], domain=MS, **attrs)
    scale = numpy_helper.from_array(np.linspace(0.5, 1.5, width).astype(dtype), "scale")
    kind = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return _model(
        [node], [("x", [1, None, heads * width]), ("z", [1, None, heads * width])], ["y"], [scale], kind
    )


@pytest.mark.parametrize("activation", [None, "silu", "sigmoid"])
def test_gated_rms_norm_is_rewritten_to_the_same_values(activation: str | None) -> None:
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((1, 7, 48)).astype(np.float32) * 3,
        "z": rng.standard_normal((1, 7, 48)).astype(np.float32) * 3,
    }
    (want,) = _run(_gated_norm(activation), feeds)
    original = _gated_norm(activation)
    done = rewrite_hybrid_ops(original)
    model, report = done.model, done.report
    assert [n.op_type for n in original.graph.node] == ["GatedRMSNorm"], "the input model must not change"
    assert report.rewritten and not report.skipped
    assert not any(n.op_type == "GatedRMSNorm" for n in model.graph.node)
    (got,) = _run(model, feeds)
    # the op's own math in numpy: each head's 16 values normalised, scaled, gated
    x, z = feeds["x"].reshape(1, 7, 3, 16).astype(np.float64), feeds["z"].astype(np.float64)
    norm = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * np.linspace(0.5, 1.5, 16)
    gate = 1 / (1 + np.exp(-z)) if activation == "sigmoid" else z / (1 + np.exp(-z))
    exact = norm.reshape(1, 7, 48) * gate
    np.testing.assert_allclose(want, exact, rtol=2e-6, atol=2e-6)  # the export's op
    np.testing.assert_allclose(got, exact, rtol=2e-6, atol=2e-6)  # the rewrite: as close
    assert not np.array_equal(got, np.zeros_like(got))


def test_gated_rms_norm_left_alone_where_the_rewrite_does_not_apply() -> None:
    done = rewrite_hybrid_ops(_gated_norm("silu", dtype=np.float16))
    model, report = done.model, done.report
    assert not report.rewritten and "not float32" in next(iter(report.skipped.values()))
    assert [n.op_type for n in model.graph.node] == ["GatedRMSNorm"]
    done = rewrite_hybrid_ops(_gated_norm("relu"))
    model, report = done.model, done.report
    assert not report.rewritten and "relu" in next(iter(report.skipped.values()))


def _conv(activation: str) -> onnx.ModelProto:
    node = helper.make_node(
        "CausalConvWithState",
        ["x", "w", "", "past"],
        ["y", "present"],
        domain=MS,
        activation=activation,
        ndim=1,
    )
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((12, 1, 4)).astype(np.float32), "w")
    return _model([node], [("x", [1, 12, None]), ("past", [1, 12, 3])], ["y", "present"], [w])


def test_silu_fused_causal_conv_runs_without_activation_then_silu() -> None:
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((1, 12, 9)).astype(np.float32),
        "past": rng.standard_normal((1, 12, 3)).astype(np.float32),
    }
    want_y, want_state = _run(_conv("silu"), feeds)
    original = _conv("silu")
    done = rewrite_hybrid_ops(original)
    model, report = done.model, done.report
    (conv,) = original.graph.node  # the input model must not change
    assert next(a.s for a in conv.attribute if a.name == "activation") == b"silu"
    assert len(report.rewritten) == 1
    assert [n.op_type for n in model.graph.node] == ["CausalConvWithState", "QuickGelu"]
    got_y, got_state = _run(model, feeds)
    np.testing.assert_array_equal(got_state, want_state)  # the window of inputs: untouched
    np.testing.assert_allclose(got_y, want_y, rtol=1e-6, atol=1e-6)
    raw, _ = _run(_conv("none"), feeds)
    assert np.abs(got_y - raw).max() > 0.1, "the SiLU must still be applied"
    done = rewrite_hybrid_ops(_conv("none"))
    untouched, report = done.model, done.report
    assert not report.rewritten and [n.op_type for n in untouched.graph.node] == ["CausalConvWithState"]


@pytest.fixture(scope="module", params=["hybrid-genai", "hybrid-mobius"])
def fused_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp(request.param), request.param, TinySpec.hybrid())


def _greedy(session: DecoderSession, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    state = session.new_state(len(prompt) + steps + 1)
    rows = [session.forward(state, np.array([prompt]), 1)[0, -1].copy()]
    tokens = [int(np.argmax(rows[-1]))]
    for _ in range(steps):
        rows.append(session.step(state, tokens[-1]).reshape(-1).copy())
        tokens.append(int(np.argmax(rows[-1])))
    return tokens, rows


def test_sessions_run_fast_ops_by_default_with_the_exports_logits_and_tokens(
    fused_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = ModelPackage.open(fused_dir)
    path, io = fused_dir / "model.onnx", package.io
    fast = DecoderSession(session_graph(path, io), threads=1)
    spec = TinySpec.hybrid()
    assert len(fast.fast_ops.rewritten) == 2 * len(spec.linear_layers)  # a norm and a conv per layer
    exported = DecoderSession(session_graph(path, io, fast_ops=False), threads=1)
    assert not exported.fast_ops.rewritten
    monkeypatch.setenv("ONNXGEN_FAST_OPS", "0")
    assert not onnxgen.load(fused_dir, threads=1).session.fast_ops.rewritten
    prompt = [5, 17, 3, 42, 8, 99, 23, 7]
    got, got_rows = _greedy(fast, prompt, 24)
    want, want_rows = _greedy(exported, prompt, 24)
    assert got == want
    for a, b in zip(got_rows, want_rows, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    # and as close to the numpy ground truth as the export's own ops are
    truth = reference_logits(spec, make_weights(spec), [*prompt, *got[:-1]])[len(prompt) - 1 :]
    fast_err = max(np.abs(r - t).max() for r, t in zip(got_rows, truth, strict=True))
    export_err = max(np.abs(r - t).max() for r, t in zip(want_rows, truth, strict=True))
    assert fast_err <= max(4 * export_err, 1e-5)


def _with_accuracy_level(model_dir: Path, level: int, out_dir: Path) -> Path:
    """A copy of an int4 fixture package whose MatMulNBits nodes compute at ``level``."""
    shutil.copytree(model_dir, out_dir)
    model = onnx.load(str(out_dir / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            node.attribute.append(helper.make_attribute("accuracy_level", level))
    onnx.save(model, str(out_dir / "model.onnx"))
    return out_dir


def test_by_default_the_pass_skips_exports_that_quantize_activations_to_int8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """There a rounding difference becomes a quantization step (logits moved by up to 0.15 on a 60M
    Qwen3.5 int4 export), so the export's ops run unless fast ops are asked for."""
    int4 = build_model(tmp_path / "int4", "hybrid-genai", TinySpec.hybrid(), precision="int4")
    level4 = _with_accuracy_level(int4, 4, tmp_path / "int4-level4")
    for model_dir, auto in ((int4, True), (level4, False)):
        io = ModelPackage.open(model_dir).io
        path = model_dir / "model.onnx"
        session = DecoderSession(session_graph(path, io), threads=1)
        assert bool(session.fast_ops.rewritten) is auto
        assert auto or "int8 activations" in session.fast_ops.off
        assert DecoderSession(session_graph(path, io, fast_ops=True), threads=1).fast_ops.rewritten
        assert not DecoderSession(session_graph(path, io, fast_ops=False), threads=1).fast_ops.rewritten
        monkeypatch.setenv("ONNXGEN_FAST_OPS", "1")  # EngineConfig.from_env reads it for load()
        assert onnxgen.load(model_dir, threads=1).session.fast_ops.rewritten
        monkeypatch.setenv("ONNXGEN_FAST_OPS", "0")
        assert not onnxgen.load(model_dir, threads=1).session.fast_ops.rewritten
        monkeypatch.delenv("ONNXGEN_FAST_OPS")
