"""Gated DeltaNet (linear-attention) token mixers for the tiny hybrid decoders, in two export forms.

- :func:`linear_layer_fused` uses the ``com.microsoft`` ops onnxruntime-genai's builder emits for
  Qwen3.5: ``CausalConvWithState``, ``LinearAttentionGate``, ``LinearAttention``, ``GatedRMSNorm``.
- :func:`linear_layer_scan` uses standard ONNX only: Concat + Conv + Slice for the causal conv and a
  ``Scan`` over the sequence axis for the recurrence (the form mobius ``--ep onnx-standard`` produces).

Both read the normed hidden state ``x`` [batch, seq, hidden], the conv state [batch, conv_dim, K-1] and the
recurrent state [batch, Hv, dk, dv] from graph inputs named by the caller, write the present states to the
names the caller gives, and return the mixer output [batch, seq, hidden] (before the residual add).
:mod:`onnxgen.testing.reference_linear` is the numpy ground truth for both. Both need default-domain
opset >= 18 (axes as inputs); the fused form also needs ``com.microsoft`` opset 1.

Contracts checked on onnxruntime 1.32 (see tests/testing/test_linear_layers.py):

- ``CausalConvWithState``: channels-first [B, C, T] input, weight [C, 1, K] as stored, no bias,
  ``activation="silu"``; its present state is the last K-1 columns of concat(past, input), also for T < K-1.
- ``LinearAttention``: ``update_rule="gated_delta"``, per-head scalar decay (log space) and beta [B, T, Hv],
  state [B, H, dk, dv]. No L2 norm inside, so q and k are normalised before. Its GQA shares one KV head
  across query heads, the opposite of Gated DeltaNet, so q and k are repeated to Hv heads and
  ``q_num_heads = kv_num_heads = Hv``. ``scale`` is set explicitly to dk^-1/2 (the op's 0.0 default
  derives the same value from the query width).
- ``GatedRMSNorm``: per-head norm over the trailing dv of [B, T, Hv*dv], ``epsilon = spec.rms_eps``
  (the op defaults to 1e-5), gate silu(z).
- ``Scan``: one state variable (the recurrent state), five scan inputs q, k, v, g, beta scanned on axis 1
  (``scan_input_axes=[1]*5``), one scan output o on axis 1; the body has only plain ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxgen.testing.graph import GraphBuilder
from onnxgen.testing.reference_linear import L2_EPS
from onnxgen.testing.spec import TinySpec

MS = "com.microsoft"


@dataclass(frozen=True)
class _Geom:
    hk: int
    hv: int
    dk: int
    dv: int
    k: int

    @classmethod
    def of(cls, spec: TinySpec) -> _Geom:
        if spec.conv_kernel < 2:
            raise ValueError(f"TinySpec.conv_kernel must be >= 2 for a conv state, got {spec.conv_kernel}")
        return cls(
            spec.lin_key_heads, spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim, spec.conv_kernel
        )


def _weights(b: GraphBuilder, w: dict[str, np.ndarray], layer: int, names: tuple[str, ...]) -> dict[str, str]:
    """Initializers for some of one layer's linear-attention weights, keyed by short name (``qkv``, ...)."""
    p = f"layers.{layer}.lin."
    return {n: b.const(np.ascontiguousarray(w[p + n], dtype=np.float32), name=p + n) for n in names}


def _op(b: GraphBuilder, op_type: str, inputs: list[str], **attrs: Any) -> str:
    """One single-output node; returns its output name."""
    out = b.op(op_type, inputs, **attrs)
    if not isinstance(out, str):
        raise TypeError(f"{op_type} was expected to have one output, got {out}")
    return out


def _ops(b: GraphBuilder, op_type: str, inputs: list[str], outputs: list[str], **attrs: Any) -> list[str]:
    """One node with several named outputs; returns their names."""
    b.op(op_type, inputs, outputs=outputs, **attrs)
    return outputs


def _silu(b: GraphBuilder, x: str) -> str:
    return _op(b, "Mul", [x, _op(b, "Sigmoid", [x])])


def _l2norm_heads(b: GraphBuilder, x: str, g: _Geom, heads: int, dim: int, scale: float | None) -> str:
    """[B, T, heads*dim] -> [B, T, Hv, dim]: L2-normalise each head (HF form), repeat to Hv heads, scale."""
    x4 = _op(b, "Reshape", [x, b.const([0, 0, heads, dim])])
    ss = _op(b, "ReduceSum", [_op(b, "Mul", [x4, x4]), b.const([-1])], keepdims=1)
    inv = _op(b, "Reciprocal", [_op(b, "Sqrt", [_op(b, "Add", [ss, b.const(np.float32(L2_EPS))])])])
    y = _op(b, "Mul", [x4, inv])
    if scale is not None:
        y = _op(b, "Mul", [y, b.const(np.float32(scale))])
    if heads != g.hv:  # value head h reads key head floor(h * Hk / Hv)
        y = _op(b, "Gather", [y, b.const(np.arange(g.hv, dtype=np.int64) * heads // g.hv)], axis=2)
    return y


def _qkv_heads(b: GraphBuilder, act: str, g: _Geom, q_scale: float | None) -> tuple[str, str, str]:
    """Split the activated conv output [B, T, conv_dim] into q, k [B, T, Hv, dk] and v [B, T, Hv, dv]."""
    sizes = b.const([g.hk * g.dk, g.hk * g.dk, g.hv * g.dv])
    q, k, v = _ops(b, "Split", [act, sizes], [b.fresh("q"), b.fresh("k"), b.fresh("v")], axis=-1)
    q4 = _l2norm_heads(b, q, g, g.hk, g.dk, q_scale)
    k4 = _l2norm_heads(b, k, g, g.hk, g.dk, None)
    v4 = _op(b, "Reshape", [v, b.const([0, 0, g.hv, g.dv])])
    return q4, k4, v4


def _packed(b: GraphBuilder, x4: str) -> str:
    return _op(b, "Reshape", [x4, b.const([0, 0, -1])])


def linear_layer_fused(
    b: GraphBuilder,
    x: str,
    w: dict[str, np.ndarray],
    spec: TinySpec,
    layer: int,
    conv_in: str,
    rec_in: str,
    conv_out: str,
    rec_out: str,
) -> str:
    """Gated DeltaNet mixer from ``com.microsoft`` fused ops; returns the [B, T, hidden] output name."""
    g = _Geom.of(spec)
    wn = _weights(b, w, layer, ("qkv", "z", "a", "b", "conv", "dt_bias", "norm", "out"))
    mixed_t = _op(b, "Transpose", [_op(b, "MatMul", [x, wn["qkv"]])], perm=[0, 2, 1])  # [B, C, T]
    conv_t = _ops(
        b,
        "CausalConvWithState",
        [mixed_t, wn["conv"], "", conv_in],
        [b.fresh("causal_conv"), conv_out],
        domain=MS,
        activation="silu",
    )[0]
    act = _op(b, "Transpose", [conv_t], perm=[0, 2, 1])  # [B, T, C]
    q4, k4, v4 = _qkv_heads(b, act, g, None)

    decay_scale = b.const(-np.exp(w[f"layers.{layer}.lin.A_log"]).astype(np.float32))
    a_proj = _op(b, "MatMul", [x, wn["a"]])
    b_proj = _op(b, "MatMul", [x, wn["b"]])
    gate_ins = [a_proj, wn["dt_bias"], decay_scale, b_proj]
    decay, beta = _ops(b, "LinearAttentionGate", gate_ins, [b.fresh("decay"), b.fresh("beta")], domain=MS)
    o = _ops(
        b,
        "LinearAttention",
        [_packed(b, q4), _packed(b, k4), _packed(b, v4), rec_in, decay, beta],
        [b.fresh("linear_attention"), rec_out],
        domain=MS,
        q_num_heads=g.hv,
        kv_num_heads=g.hv,
        scale=float(g.dk**-0.5),
        update_rule="gated_delta",
    )[0]
    z = _op(b, "MatMul", [x, wn["z"]])
    normed = _op(
        b, "GatedRMSNorm", [o, wn["norm"], z], domain=MS, epsilon=float(spec.rms_eps), activation="silu"
    )
    return _op(b, "MatMul", [normed, wn["out"]])


def _gated_delta_body(b: GraphBuilder) -> tuple[GraphBuilder, list[str]]:
    """The Scan body for one token: state [B, Hv, dk, dv]; q, k [B, Hv, dk], v [B, Hv, dv], g, beta [B, Hv].

    Every name comes from the parent builder so the body never shadows an outer-scope name.
    """
    body = GraphBuilder(b.fresh("gated_delta_step"))

    def op(op_type: str, inputs: list[str], **attrs: object) -> str:
        return _ops(body, op_type, inputs, [b.fresh(op_type.lower())], **attrs)[0]

    s, q, k, v, g, beta = (
        body.input(b.fresh(n), "float32", shape)
        for n, shape in (
            ("state", [None] * 4),
            ("q_t", [None] * 3),
            ("k_t", [None] * 3),
            ("v_t", [None] * 3),
            ("g_t", [None] * 2),
            ("beta_t", [None] * 2),
        )
    )
    ax2 = body.const([2], name=b.fresh("axis2"))
    ax3 = body.const([3], name=b.fresh("axis3"))
    ax23 = body.const([2, 3], name=b.fresh("axes23"))
    s1 = op("Mul", [s, op("Unsqueeze", [op("Exp", [g]), ax23])])  # S <- exp(g) S
    u = op("MatMul", [op("Unsqueeze", [k, ax2]), s1])  # k^T S: [B, Hv, 1, dv]
    delta = op("Mul", [op("Sub", [op("Unsqueeze", [v, ax2]), u]), op("Unsqueeze", [beta, ax23])])
    s2 = op("Add", [s1, op("MatMul", [op("Unsqueeze", [k, ax3]), delta])])  # S + k (x) beta (v - u)
    o = op("Squeeze", [op("MatMul", [op("Unsqueeze", [q, ax2]), s2]), ax2])  # q^T S: [B, Hv, dv]
    body.output(s2, "float32", [None] * 4)
    body.output(o, "float32", [None] * 3)
    return body, [s2, o]


def linear_layer_scan(
    b: GraphBuilder,
    x: str,
    w: dict[str, np.ndarray],
    spec: TinySpec,
    layer: int,
    conv_in: str,
    rec_in: str,
    conv_out: str,
    rec_out: str,
    fused_ops: bool = False,
) -> str:
    """Gated DeltaNet mixer from standard ONNX ops with a ``Scan`` over the sequence axis. With
    ``fused_ops`` the convolution and the gated norm are the builder's ``CausalConvWithState`` and
    ``GatedRMSNorm`` (a builder export whose ``LinearAttention`` was rewritten into a Scan)."""
    g = _Geom.of(spec)
    wn = _weights(b, w, layer, ("qkv", "z", "a", "b", "conv", "dt_bias", "norm", "out"))
    mixed_t = _op(b, "Transpose", [_op(b, "MatMul", [x, wn["qkv"]])], perm=[0, 2, 1])  # [B, C, T]
    if fused_ops:
        conv_in_ = [mixed_t, wn["conv"], "", conv_in]
        silu = _ops(
            b,
            "CausalConvWithState",
            conv_in_,
            [b.fresh("causal_conv"), conv_out],
            domain=MS,
            activation="silu",
        )[0]
    else:
        full = _op(b, "Concat", [conv_in, mixed_t], axis=2)  # [B, C, K-1+T]
        conv = _op(b, "Conv", [full, wn["conv"]], group=spec.conv_dim, kernel_shape=[g.k])  # [B, C, T]
        ends = b.const([np.iinfo(np.int64).max])
        _ops(b, "Slice", [full, b.const([-(g.k - 1)]), ends, b.const([2])], [conv_out])
        silu = _silu(b, conv)
    act = _op(b, "Transpose", [silu], perm=[0, 2, 1])  # [B, T, C]
    q4, k4, v4 = _qkv_heads(b, act, g, float(g.dk**-0.5))

    decay_scale = b.const(-np.exp(w[f"layers.{layer}.lin.A_log"]).astype(np.float32))
    a_proj = _op(b, "Add", [_op(b, "MatMul", [x, wn["a"]]), wn["dt_bias"]])
    decay = _op(b, "Mul", [_op(b, "Softplus", [a_proj]), decay_scale])  # [B, T, Hv]
    beta = _op(b, "Sigmoid", [_op(b, "MatMul", [x, wn["b"]])])
    body, _ = _gated_delta_body(b)
    o = _ops(
        b,
        "Scan",
        [rec_in, q4, k4, v4, decay, beta],
        [rec_out, b.fresh("scan_o")],
        body=body.graph(),
        num_scan_inputs=5,
        scan_input_axes=[1] * 5,
        scan_output_axes=[1],
    )[1]  # [B, T, Hv, dv]
    if fused_ops:
        z = _op(b, "MatMul", [x, wn["z"]])
        normed = _op(
            b, "GatedRMSNorm", [_packed(b, o), wn["norm"], z], domain=MS, epsilon=float(spec.rms_eps),
            activation="silu",
        )  # fmt: skip
        return _op(b, "MatMul", [normed, wn["out"]])

    ms = _op(b, "ReduceMean", [_op(b, "Mul", [o, o]), b.const([-1])], keepdims=1)
    inv = _op(b, "Reciprocal", [_op(b, "Sqrt", [_op(b, "Add", [ms, b.const(np.float32(spec.rms_eps))])])])
    normed = _op(b, "Mul", [_op(b, "Mul", [o, inv]), wn["norm"]])
    z4 = _op(b, "Reshape", [_op(b, "MatMul", [x, wn["z"]]), b.const([0, 0, g.hv, g.dv])])
    gated = _packed(b, _op(b, "Mul", [normed, _silu(b, z4)]))
    return _op(b, "MatMul", [gated, wn["out"]])
