"""Blocks every tiny decoder shares: embedding, RMS norms, projections, SwiGLU MLP, the layer stack, lm head.

The math is one model (see :mod:`onnxgen.testing.reference`); the export style picks its ops:

- ``norms="fused"``: ``com.microsoft::SkipSimplifiedLayerNormalization`` with the residual add fused (the
  onnxruntime-genai builder's form). Its very first norm has no residual; the builder writes
  ``SimplifiedLayerNormalization`` there, an onnxruntime-only op in the ONNX domain that ``onnx.checker``
  rejects, so the fixture writes that one norm in plain ops.
- ``norms="plain"``: Add + Pow/ReduceMean/Sqrt/Div/Mul (optimum / hand-made torch exports).
- ``norms="rms_op"``: Add + opset-23 ``RMSNormalization`` (mobius).

``precision="int4"`` turns every projection into ``com.microsoft::MatMulNBits`` (see :mod:`.quant`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from onnxgen.testing.graph import GraphBuilder
from onnxgen.testing.quant import BITS, quantize_int4
from onnxgen.testing.spec import TinySpec

MS = "com.microsoft"
Norms = Literal["fused", "plain", "rms_op"]
Precision = Literal["fp32", "int4"]
# A token mixer: (layer index, normed hidden state [B, S, hidden]) -> mixer output [B, S, hidden].
Mixer = Callable[[int, str], str]


@dataclass
class Decoder:
    """The graph under construction, the weights, and the export style of its blocks."""

    b: GraphBuilder
    spec: TinySpec
    w: dict[str, np.ndarray]
    norms: Norms = "plain"
    precision: Precision = "fp32"
    _weights: dict[str, str] = field(default_factory=dict)

    def weight(self, name: str) -> str:
        """The initializer holding weight ``name`` (created once, named after the weight)."""
        if name not in self._weights:
            self._weights[name] = self.b.const(
                np.ascontiguousarray(self.w[name], dtype=np.float32), name=name
            )
        return self._weights[name]

    def table(self, name: str, value: np.ndarray) -> str:
        """A named constant shared by several nodes (created on first use)."""
        if name not in self._weights:
            self._weights[name] = self.b.const(value, name=name)
        return self._weights[name]

    def const(self, value: np.ndarray | float | int | list[int]) -> str:
        return self.b.const(value)


def project(d: Decoder, x: str, name: str, out: str | None = None) -> str:
    """``x @ W[name]``: MatMul in fp32, MatMulNBits in int4."""
    if d.precision == "fp32":
        return d.b.op1("MatMul", [x, d.weight(name)], out=out)
    qw = quantize_int4(d.w[name])
    packed = d.b.const(qw.packed, name=f"{name}.int4")
    scales = d.b.const(qw.scales, name=f"{name}.scales")
    return d.b.op1(
        "MatMulNBits",
        [x, packed, scales],
        domain=MS,
        out=out,
        K=qw.k,
        N=qw.n,
        bits=BITS,
        block_size=qw.block_size,
    )


def _rms_plain(d: Decoder, x: str, name: str) -> str:
    b = d.b
    ms = b.op1("ReduceMean", [b.op1("Pow", [x, d.const(np.float32(2.0))]), d.const([-1])], keepdims=1)
    rms = b.op1("Sqrt", [b.op1("Add", [ms, d.const(np.float32(d.spec.rms_eps))])])
    return b.op1("Mul", [b.op1("Div", [x, rms]), d.weight(name)])


def rms_norm(d: Decoder, x: str, name: str) -> str:
    """RMS norm of ``x`` over the last axis with weight ``name`` (no residual)."""
    if d.norms == "rms_op":
        return d.b.op1("RMSNormalization", [x, d.weight(name)], axis=-1, epsilon=float(d.spec.rms_eps))
    return _rms_plain(d, x, name)


def add_norm(d: Decoder, residual: str, delta: str | None, name: str) -> tuple[str, str]:
    """``residual += delta`` then RMS norm; returns (normed, new residual)."""
    if delta is None:
        return rms_norm(d, residual, name), residual
    if d.norms == "fused":
        normed, _, _, total = d.b.opn(
            "SkipSimplifiedLayerNormalization",
            [delta, residual, d.weight(name)],
            [None, None, None, None],
            domain=MS,
            epsilon=float(d.spec.rms_eps),
        )
        return normed, total
    total = d.b.op1("Add", [residual, delta])
    return rms_norm(d, total, name), total


def mlp(d: Decoder, x: str, layer: int) -> str:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""
    p = f"layers.{layer}.mlp."
    gate = project(d, x, p + "gate")
    silu = d.b.op1("Mul", [gate, d.b.op1("Sigmoid", [gate])])
    return project(d, d.b.op1("Mul", [silu, project(d, x, p + "up")]), p + "down")


def decoder_stack(d: Decoder, input_ids: str, mixer: Mixer, logits: str = "logits") -> str:
    """Embedding, every layer (mixer + MLP, pre-norm residual), final norm and lm head; returns ``logits``."""
    residual = d.b.op1("Gather", [d.weight("embed"), input_ids], axis=0)
    delta: str | None = None
    for layer in range(d.spec.num_layers):
        x, residual = add_norm(d, residual, delta, f"layers.{layer}.input_norm")
        delta = mixer(layer, x)
        x, residual = add_norm(d, residual, delta, f"layers.{layer}.post_norm")
        delta = mlp(d, x, layer)
    x, _ = add_norm(d, residual, delta, "final_norm")
    return project(d, x, "lm_head", out=logits)
