"""int4 blockwise quantization in the MatMulNBits layout, checked against onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.testing import TinySpec, build_model, make_weights
from onnxgen.testing.loop import run_teacher_forced
from onnxgen.testing.quant import dequantize_int4, quantize_int4
from onnxgen.testing.reference import reference_logits

PROMPTS = [[5, 17, 99, 3, 250, 7], [11, 12, 13, 14, 15, 16]]
STEPS = [[40, 41, 42], [50, 51, 52]]
PROJECTIONS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")


def test_int4_packing_puts_even_elements_in_low_nibbles_with_zero_point_8() -> None:
    # One column of 32 values (i % 16 - 8) / 2: the largest magnitude, -4, maps to level 0 with scale 0.5,
    # so element i is stored as level i % 16.
    w = ((np.arange(32) % 16 - 8) / 2).astype(np.float32)[:, None]
    qw = quantize_int4(w)
    assert qw.packed.shape == (1, 1, 16) and qw.packed.dtype == np.uint8
    np.testing.assert_array_equal(qw.scales, [0.5])
    expected = [(2 * j) % 16 | ((2 * j + 1) % 16) << 4 for j in range(16)]
    assert qw.packed[0, 0].tolist() == expected
    np.testing.assert_array_equal(dequantize_int4(qw), w)


def test_dequantized_weight_is_within_one_step_of_the_float_weight() -> None:
    w = np.random.default_rng(0).standard_normal((96, 24)).astype(np.float32)
    qw = quantize_int4(w)
    step = np.abs(qw.scales.reshape(24, 3)).T.repeat(32, axis=0)  # [K, N]
    err = np.abs(dequantize_int4(qw) - w)
    assert (err <= step + 1e-6).all()
    assert err.mean() < 0.3 * step.mean()


def test_input_features_that_do_not_fill_a_block_are_zero_padded() -> None:
    w = np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)
    qw = quantize_int4(w)
    assert qw.packed.shape == (8, 2, 16) and qw.scales.shape == (16,)
    assert dequantize_int4(qw).shape == (40, 8)
    assert np.abs(dequantize_int4(qw) - w).max() < 0.5


def test_matmulnbits_in_onnxruntime_reproduces_the_dequantized_matmul() -> None:
    k, n = 72, 48  # K not a multiple of the block: the padded tail must not contribute
    rng = np.random.default_rng(2)
    w = rng.standard_normal((k, n)).astype(np.float32)
    a = rng.standard_normal((3, 5, k)).astype(np.float32)
    qw = quantize_int4(w)
    node = helper.make_node(
        "MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 5, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5, n])],
        initializer=[numpy_helper.from_array(qw.packed, "b"), numpy_helper.from_array(qw.scales, "s")],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"a": a})
    np.testing.assert_allclose(y, a @ dequantize_int4(qw), atol=1e-4, rtol=1e-5)
    assert np.abs(y - a @ w).max() > 1e-2  # it really is quantized


def dequantized(spec: TinySpec) -> dict[str, np.ndarray]:
    w = make_weights(spec)
    names = [f"layers.{i}.{p}" for i in range(spec.num_layers) for p in PROJECTIONS] + ["lm_head"]
    return w | {n: dequantize_int4(quantize_int4(w[n])) for n in names if n in w}


@pytest.mark.parametrize(
    ("family", "spec"), [("genai-dense", TinySpec()), ("hybrid-genai", TinySpec.hybrid())]
)
def test_int4_model_computes_the_reference_with_dequantized_weights(
    tmp_path: Path, family: str, spec: TinySpec
) -> None:
    path = build_model(tmp_path, family, spec, precision="int4")
    got = run_teacher_forced(path, PROMPTS, STEPS)
    wq = dequantized(spec)
    for row, (prompt, steps) in enumerate(zip(PROMPTS, STEPS, strict=True)):
        np.testing.assert_allclose(got[row], reference_logits(spec, wq, prompt + steps), atol=1e-4, rtol=0)


def test_int4_logits_are_close_to_but_not_equal_to_fp32(tmp_path: Path) -> None:
    fp32 = run_teacher_forced(build_model(tmp_path / "f", "genai-dense"), PROMPTS, STEPS)
    int4 = run_teacher_forced(build_model(tmp_path / "q", "genai-dense", precision="int4"), PROMPTS, STEPS)
    for a, b in zip(fp32, int4, strict=True):
        rel = np.linalg.norm(a - b) / np.linalg.norm(a)
        assert 1e-3 < rel < 0.35
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.95


def test_int4_model_has_every_projection_as_matmulnbits_and_is_smaller(tmp_path: Path) -> None:
    spec = TinySpec()
    path = build_model(tmp_path / "q", "genai-dense", spec, precision="int4")
    model = onnx.load(str(path / "model.onnx"), load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == len(PROJECTIONS) * spec.num_layers + 1
    assert not [n for n in model.graph.node if n.op_type == "MatMul"]
    attrs = {a.name: a.i for a in nbits[0].attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 32 and attrs["K"] == spec.hidden
    packed = {t.name: list(t.dims) for t in model.graph.initializer}[nbits[0].input[1]]
    assert packed == [attrs["N"], spec.hidden // 32, 16]
    fp32 = build_model(tmp_path / "f", "genai-dense", spec)
    assert (path / "model.onnx.data").stat().st_size < 0.5 * (fp32 / "model.onnx.data").stat().st_size
