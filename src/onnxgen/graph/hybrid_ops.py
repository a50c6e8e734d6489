"""Pass: run two hybrid contrib ops through onnxruntime's vectorized kernels on the CPU.

Qwen3.5-style exports (onnxruntime-genai's builder, :mod:`onnxgen.testing.linear`) normalise the linear
attention's output with ``com.microsoft::GatedRMSNorm`` and run the short convolution through
``com.microsoft::CausalConvWithState`` with a fused SiLU. onnxruntime 1.32's CPU kernels of both compute
the activation one element at a time, which made them a large share of a hybrid's prefill
(docs/benchmarks.md). The same math runs on
onnxruntime's vectorized kernels when written as

- ``GatedRMSNorm(X, scale, Z)`` (SiLU or sigmoid gate) ->
  ``Reshape(X, [-1, C]) -> SimplifiedLayerNormalization(scale) -> Reshape(shape of X)``, times
  ``QuickGelu(Z, alpha=1)`` (= ``Z * sigmoid(Z)``) or ``Sigmoid(Z)``;
- ``CausalConvWithState(..., activation="silu")`` -> the same node with ``activation="none"``, then
  ``QuickGelu(alpha=1)`` on its output (the state output is the window of inputs either way).

The results are the same math rounded differently: on fp32 exports the logits move by a few units in the
last place (~1e-6 on the demo model, ~1e-5 on a 60M Qwen3.5), like a different thread count or instruction
set would move them, and greedy tokens stay the export's unless two logits are that close. Where a
``MatMulNBits`` computes on int8 activations (``accuracy_level`` 4, onnxruntime-genai's int4 default), the
activations' quantization turns such differences into whole quantization steps: on the 60M Qwen3.5 int4
export the logits moved by up to 0.15 (of ~4) and greedy tokens left onnxruntime-genai's at the second
token. So by default (:func:`wanted`) the pass runs on graphs without such nodes; ``load(...,
fast_ops=True)`` (or ``ONNXGEN_FAST_OPS=1``, read by :class:`onnxgen.config.EngineConfig`) runs it anyway,
``fast_ops=False`` (``ONNXGEN_FAST_OPS=0``)
never. float32 only (the fused kernels compute fp16 in float32 internally; no rewrite for them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgen.graph.passes import PassResult
from onnxgen.graph.state_window import attribute

MS = "com.microsoft"
_SILU = (b"silu", b"swish")
_REWRITTEN = ("GatedRMSNorm", "CausalConvWithState")


def int8_activations(model: onnx.ModelProto) -> bool:
    """Whether a ``MatMulNBits`` of the graph computes on int8 activations (``accuracy_level`` 4)."""
    return any(
        n.op_type == "MatMulNBits"
        and n.domain == MS
        and next((a.i for a in n.attribute if a.name == "accuracy_level"), 0) >= 4
        for n in model.graph.node
    )


def wanted(model: onnx.ModelProto, requested: bool | None) -> tuple[bool, str]:
    """Whether to run the pass on ``model``: ``requested`` (from ``EngineConfig.fast_ops``), else on
    unless a MatMulNBits quantizes its activations to int8; and why not when not."""
    if requested is not None:
        return requested, "" if requested else "fast_ops=False"
    if int8_activations(model):
        return False, (
            "a MatMulNBits computes on int8 activations (accuracy_level 4), which would turn the pass's "
            "rounding differences into quantization steps; fast_ops=True runs it anyway"
        )
    return True, ""


@dataclass
class FastOps:
    """What :func:`rewrite_hybrid_ops` did: the nodes rewritten, the ones left (node name: why)."""

    rewritten: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    off: str = ""  # why the pass did not run at all (see :func:`wanted`)

    def summary(self) -> str:
        """One line for reports (``onnxgen inspect``, ``onnxgen bench``)."""
        if self.rewritten:
            return f"{len(self.rewritten)} hybrid ops on vectorized kernels"
        return f"off: {self.off}" if self.off else "nothing to rewrite"


def _float_types(graph: onnx.GraphProto) -> dict[str, int]:
    """Element types of the values the graph declares (inputs, outputs, value_info, initializers)."""
    types = {t.name: t.data_type for t in graph.initializer}
    for v in (*graph.input, *graph.output, *graph.value_info):
        if v.type.HasField("tensor_type"):
            types[v.name] = v.type.tensor_type.elem_type
    return types


def rewrite_hybrid_ops(model: onnx.ModelProto) -> PassResult[FastOps]:
    """A copy of ``model`` with its float32 ``GatedRMSNorm`` and SiLU-fused ``CausalConvWithState`` nodes
    on vectorized kernels (``model`` itself when there is nothing to rewrite), and what was done."""
    if not any(n.domain == MS and n.op_type in _REWRITTEN for n in model.graph.node):
        return PassResult(model, False, FastOps())
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    graph = rewritten.graph
    report = FastOps()
    initializers = {t.name: t for t in graph.initializer}
    types = _float_types(graph)
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []

    def constant(name: str, values: list[int]) -> str:
        if name not in initializers:
            initializers[name] = numpy_helper.from_array(np.array(values, dtype=np.int64), name)
            added.append(initializers[name])
        return name

    for i, node in enumerate(graph.node):
        label = node.name or f"{node.op_type}_{i}"
        if node.domain == MS and node.op_type == "GatedRMSNorm":
            why = _gated_norm_blocker(node, initializers)
            if why:
                report.skipped[label] = why
                nodes.append(node)
                continue
            x, scale, gate = node.input[:3]
            width = int(initializers[scale].dims[-1])
            act = attribute(node, "activation")
            eps = attribute(node, "epsilon")
            p = f"/onnxgen_fast_ops/{label}"
            flat, normed, shape, back, gated = (f"{p}/{s}" for s in ("rows", "norm", "shape", "back", "gate"))
            nodes += [
                helper.make_node(
                    "Reshape", [x, constant(f"/onnxgen_fast_ops/rows_{width}", [-1, width])], [flat]
                ),
                helper.make_node(
                    "SimplifiedLayerNormalization",
                    [flat, scale],
                    [normed],
                    axis=-1,
                    epsilon=eps.f if eps is not None else 1e-5,
                    stash_type=1,
                ),
                helper.make_node("Shape", [x], [shape]),
                helper.make_node("Reshape", [normed, shape], [back]),
                helper.make_node("Sigmoid", [gate], [gated])
                if act is not None and act.s == b"sigmoid"
                else helper.make_node("QuickGelu", [gate], [gated], domain=MS, alpha=1.0),
                helper.make_node("Mul", [back, gated], [node.output[0]], name=label),
            ]
            report.rewritten.append(label)
        elif node.domain == MS and node.op_type == "CausalConvWithState":
            act = attribute(node, "activation")
            if act is None or act.s not in _SILU:
                nodes.append(node)
                continue
            if types.get(node.input[0], TensorProto.FLOAT) != TensorProto.FLOAT:
                report.skipped[label] = "not float32"
                nodes.append(node)
                continue
            out = node.output[0]
            raw = f"/onnxgen_fast_ops/{label}/conv"
            act.s = b"none"
            node.output[0] = raw
            nodes += [node, helper.make_node("QuickGelu", [raw], [out], domain=MS, alpha=1.0)]
            report.rewritten.append(label)
        else:
            nodes.append(node)
    if not report.rewritten:
        return PassResult(model, False, report)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    if not any(o.domain == MS for o in rewritten.opset_import):
        rewritten.opset_import.append(helper.make_opsetid(MS, 1))
    return PassResult(rewritten, True, report)


def apply_fast_ops(model: onnx.ModelProto, requested: bool | None) -> PassResult[FastOps]:
    """:func:`rewrite_hybrid_ops` where :func:`wanted` says so; else ``model`` and why not."""
    run, why = wanted(model, requested)
    return rewrite_hybrid_ops(model) if run else PassResult(model, False, FastOps(off=why))


def _gated_norm_blocker(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> str:
    """Why ``node`` (a GatedRMSNorm) is left as it is; empty when it can be rewritten."""
    if len(node.input) < 3 or not node.input[2]:
        return "no gate input"
    act = attribute(node, "activation")
    if act is not None and act.s not in (*_SILU, b"sigmoid"):
        return f"gate activation {act.s.decode(errors='replace')!r}"
    scale = initializers.get(node.input[1])
    if scale is None or not scale.dims:
        return "scale is not a weight of known length"
    if scale.data_type != TensorProto.FLOAT:
        return "not float32"
    return ""
