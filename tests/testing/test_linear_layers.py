"""The Gated DeltaNet layer builders (fused com.microsoft ops and standard Scan) against the numpy reference."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgen.testing.graph import GraphBuilder
from onnxgen.testing.linear import linear_layer_fused, linear_layer_scan
from onnxgen.testing.reference_linear import gated_deltanet_layer_ref
from onnxgen.testing.spec import TinySpec, make_weights

Builder = Callable[..., str]
BUILDERS: dict[str, Builder] = {"fused": linear_layer_fused, "scan": linear_layer_scan}
# Hk < Hv (value heads share key heads) and Hk == Hv; dk != dv in both so a transposed state shows up.
SPECS = {
    "gqa": TinySpec(
        hidden=32, num_layers=1, layer_types=("linear",), lin_key_heads=2, lin_value_heads=4,
        lin_key_dim=8, lin_value_dim=4,
    ),
    "mha": TinySpec(
        hidden=24, num_layers=1, layer_types=("linear",), lin_key_heads=2, lin_value_heads=2,
        lin_key_dim=4, lin_value_dim=8, seed=3,
    ),
}  # fmt: skip
ATOL = 1e-4


def _one_layer_model(kind: str, spec_name: str) -> onnx.ModelProto:
    spec = SPECS[spec_name]
    hv, dk, dv = spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim
    b = GraphBuilder(f"{kind}_linear_layer")
    x = b.input("x", "float32", ["batch", "seq", spec.hidden])
    conv_in = b.input("past_conv", "float32", ["batch", spec.conv_dim, spec.conv_kernel - 1])
    rec_in = b.input("past_rec", "float32", ["batch", hv, dk, dv])
    y = BUILDERS[kind](b, x, make_weights(spec), spec, 0, conv_in, rec_in, "present_conv", "present_rec")
    b.op("Identity", [y], outputs=["y"])
    b.output("y", "float32", ["batch", "seq", spec.hidden])
    b.output("present_conv", "float32", ["batch", spec.conv_dim, spec.conv_kernel - 1])
    b.output("present_rec", "float32", ["batch", hv, dk, dv])
    return b.model()


@cache
def _session(kind: str, spec_name: str) -> ort.InferenceSession:
    model = _one_layer_model(kind, spec_name)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(kind: str, spec_name: str, x: np.ndarray, conv: np.ndarray, rec: np.ndarray) -> list[np.ndarray]:
    return _session(kind, spec_name).run(None, {"x": x, "past_conv": conv, "past_rec": rec})


def _zero_states(spec: TinySpec, batch: int) -> tuple[np.ndarray, np.ndarray]:
    conv = np.zeros((batch, spec.conv_dim, spec.conv_kernel - 1), np.float32)
    rec = np.zeros((batch, spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim), np.float32)
    return conv, rec


def _random_states(spec: TinySpec, batch: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    conv, rec = _zero_states(spec, batch)
    return (
        rng.standard_normal(conv.shape).astype(np.float32),
        (0.3 * rng.standard_normal(rec.shape)).astype(np.float32),
    )


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("kind", BUILDERS)
def test_prefill_then_single_token_steps_match_the_reference(kind: str, spec_name: str) -> None:
    spec = SPECS[spec_name]
    w = make_weights(spec)
    rng = np.random.default_rng(11)
    conv, rec = _zero_states(spec, batch=2)
    ref_conv, ref_rec = conv, rec
    for seq in (7, 1, 1, 1):
        x = rng.standard_normal((2, seq, spec.hidden)).astype(np.float32)
        y, conv, rec = _run(kind, spec_name, x, conv, rec)
        ref_y, ref_conv, ref_rec = gated_deltanet_layer_ref(x, w, spec, 0, ref_conv, ref_rec)
        assert y.shape == (2, seq, spec.hidden)
        np.testing.assert_allclose(y, ref_y, atol=ATOL, rtol=0)
        np.testing.assert_allclose(conv, ref_conv, atol=ATOL, rtol=0)
        np.testing.assert_allclose(rec, ref_rec, atol=ATOL, rtol=0)
    assert np.abs(rec).max() > 0.01  # the state really carried something


@pytest.mark.parametrize("spec_name", SPECS)
def test_fused_scan_and_reference_agree_on_a_long_prefill_from_random_states(spec_name: str) -> None:
    # 70 tokens crosses LinearAttention's default prefill chunk of 64.
    spec = SPECS[spec_name]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 70, spec.hidden)).astype(np.float32)
    conv, rec = _random_states(spec, 2, rng)
    fused = _run("fused", spec_name, x, conv, rec)
    scan = _run("scan", spec_name, x, conv, rec)
    ref = gated_deltanet_layer_ref(x, make_weights(spec), spec, 0, conv, rec)
    for got_f, got_s, want in zip(fused, scan, ref, strict=True):
        np.testing.assert_allclose(got_f, want, atol=ATOL, rtol=0)
        np.testing.assert_allclose(got_s, want, atol=ATOL, rtol=0)
        np.testing.assert_allclose(got_f, got_s, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", BUILDERS)
def test_feeding_the_state_back_token_by_token_equals_one_multi_token_run(kind: str) -> None:
    spec = SPECS["gqa"]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 6, spec.hidden)).astype(np.float32)
    conv0, rec0 = _random_states(spec, 1, rng)
    y_all, conv_all, rec_all = _run(kind, "gqa", x, conv0, rec0)
    conv, rec, ys = conv0, rec0, []
    for t in range(x.shape[1]):
        y, conv, rec = _run(kind, "gqa", x[:, t : t + 1], conv, rec)
        ys.append(y)
    np.testing.assert_allclose(np.concatenate(ys, axis=1), y_all, atol=1e-5, rtol=0)
    np.testing.assert_allclose(conv, conv_all, atol=1e-6, rtol=0)
    np.testing.assert_allclose(rec, rec_all, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_single_token_shifts_the_conv_state_by_one_column(kind: str) -> None:
    spec = SPECS["gqa"]
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 1, spec.hidden)).astype(np.float32)
    conv, rec = _random_states(spec, 3, rng)
    _, present_conv, _ = _run(kind, "gqa", x, conv, rec)
    mixed = x[:, 0] @ make_weights(spec)["layers.0.lin.qkv"]
    np.testing.assert_array_equal(present_conv[:, :, :-1], conv[:, :, 1:])
    np.testing.assert_allclose(present_conv[:, :, -1], mixed, atol=1e-6, rtol=0)


def test_the_fused_form_uses_the_com_microsoft_gated_deltanet_ops() -> None:
    model = _one_layer_model("fused", "gqa")
    ms_ops = {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    assert ms_ops == {"CausalConvWithState", "LinearAttentionGate", "LinearAttention", "GatedRMSNorm"}
    (la,) = (n for n in model.graph.node if n.op_type == "LinearAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in la.attribute}
    assert attrs["update_rule"] == b"gated_delta"
    assert attrs["q_num_heads"] == attrs["kv_num_heads"] == 4
    assert list(la.output) == [la.output[0], "present_rec"]


def test_the_scan_form_is_a_standard_scan_with_a_flat_body() -> None:
    model = _one_layer_model("scan", "gqa")
    onnx.checker.check_model(model, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    (scan,) = (n for n in model.graph.node if n.op_type == "Scan")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in scan.attribute}
    assert attrs["num_scan_inputs"] == 5
    assert scan.input[0] == "past_rec" and scan.output[0] == "present_rec"
    body_ops = {n.op_type for n in attrs["body"].node}
    assert not body_ops & {"Scan", "Loop", "If"}
    outer = {o for n in model.graph.node for o in n.output}
    assert not outer & {o for n in attrs["body"].node for o in n.output}, "body shadows an outer name"
