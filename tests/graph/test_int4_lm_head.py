from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.errors import OnnxgenError
from onnxgen.graph.int4_lm_head import BLOCK_SIZE, int4_lm_head
from onnxgen.graph.logits_to_keep import find_lm_head
from onnxgen.model.external_data import read_array
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.binding import OrtInternals
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.int4 import quantize_int4
from onnxgen.testing import build_model


def _session(model: onnx.ModelProto, folder: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    ids = np.array([[3, 17, 42, 99, 7, 11]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in model.graph.input:
        if i.name == "position_ids":
            feeds[i.name] = np.arange(6, dtype=np.int64)[None]
        elif i.name.startswith("past_key_values"):
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = np.zeros((1, dims[1], 0, dims[3]), dtype=np.float32)
    return feeds


def _dequantize(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """``[K, N]`` from the packed nibbles (low nibble first, zero point 8) and per-block scales."""
    low, high = packed & 0x0F, packed >> 4
    q = np.stack([low, high], axis=-1).reshape(packed.shape[0], -1).astype(np.float32) - 8.0
    return (q * np.repeat(scales, BLOCK_SIZE, axis=1))[:, :k].T


def test_quantized_weights_are_within_a_step_of_the_originals() -> None:
    w = np.random.default_rng(0).standard_normal((70, 24)).astype(np.float32)  # K not a block multiple
    packed, scales = quantize_int4(w)
    assert packed.shape == (24, 3, BLOCK_SIZE // 2) and scales.shape == (24, 3)
    step = np.abs(np.repeat(scales, BLOCK_SIZE, axis=1)[:, :70].T)  # (a scale may be negative)
    err = np.abs(_dequantize(packed, scales, 70) - w)
    # half a step from rounding; up to one where the side opposite a block's largest value clips at +7
    assert np.all(err <= step + 1e-6)
    assert err.mean() <= 0.3 * step.mean()  # (nibbles in the wrong order: ~4 steps)
    assert err.max() > 0  # it did round


def test_the_lm_head_becomes_int4_and_the_logits_stay_close(tmp_path: Path) -> None:
    d = build_model(tmp_path, "genai-dense")
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    head, _ = find_lm_head(model.graph, "logits")
    assert head is not None and head.op_type == "MatMul"
    result = int4_lm_head(model, "logits", d, quantize_int4)
    out = result.model
    assert result.modified and result.report == ""
    node, _ = find_lm_head(out.graph, "logits")
    assert node is not None and (node.domain, node.op_type) == ("com.microsoft", "MatMulNBits")
    weight = next(t for t in model.graph.initializer if t.name == head.input[1])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["K"], attrs["N"], attrs["bits"]) == (*weight.dims, 4)
    assert find_lm_head(model.graph, "logits")[0].op_type == "MatMul", "the input model must not change"

    feeds = _feeds(model)
    want = _session(model, d).run(["logits"], feeds)[0]
    got = _session(out, d).run(["logits"], feeds)[0]
    assert not np.array_equal(got, want)
    # the int4 weights as the pass stored them, applied in float: what the node computes, but for its
    # int8 activations
    init = {t.name: t for t in out.graph.initializer}
    deq = _dequantize(
        numpy_helper.to_array(init[node.input[1]]),
        numpy_helper.to_array(init[node.input[2]]).reshape(weight.dims[1], -1),
        weight.dims[0],
    )
    exact = read_array(weight, d)
    hidden = np.linalg.lstsq(exact.T, want[0].T, rcond=None)[0].T  # the lm_head's input, recovered
    np.testing.assert_allclose(got[0], hidden @ deq, atol=0.05 * np.abs(want).max())


def test_an_lm_head_that_is_not_a_float_matmul_is_left_alone() -> None:
    graph = helper.make_graph(
        [
            helper.make_node(
                "MatMulNBits",
                ["x", "w", "s"],
                ["logits"],
                domain="com.microsoft",
                K=32,
                N=8,
                bits=4,
                block_size=32,
            )
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])],
        [
            numpy_helper.from_array(np.zeros((8, 1, 16), dtype=np.uint8), "w"),
            numpy_helper.from_array(np.ones(8, dtype=np.float32), "s"),
        ],
    )
    model = helper.make_model(graph)
    result = int4_lm_head(model, "logits", None, quantize_int4)
    assert result.model is model and not result.modified and "MatMulNBits" in result.report
    relu = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["logits"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])],
        )
    )
    result = int4_lm_head(relu, "logits", None, quantize_int4)
    assert result.model is relu and not result.modified and "Relu" in result.report


def test_without_onnxruntimes_quantizer_the_drafter_keeps_its_exact_lm_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int4 lm_head only makes drafts cheaper: where this onnxruntime has no quantizer, the graph is
    prepared with the exact one, where the quantizer is there it gets the int4 one (the control)."""
    d = build_model(tmp_path / "model", "genai-dense")
    io = ModelPackage.open(d).io

    def prepared(cache: str) -> onnx.ModelProto:
        graph = session_graph(d / "model.onnx", io, int4_lm_head=True, cache_dir=tmp_path / cache)
        node, _ = find_lm_head(graph.load_graph().graph, "logits")
        assert node is not None
        return node

    assert prepared("with").op_type == "MatMulNBits"

    def missing() -> None:
        raise OnnxgenError("no quantize_matmul_4bits in this onnxruntime")

    monkeypatch.setattr(OrtInternals, "quantize_matmul_4bits", staticmethod(missing))
    assert prepared("without").op_type == "MatMul"
