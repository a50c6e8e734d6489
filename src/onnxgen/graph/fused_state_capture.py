"""Pass: capture the per-token inputs of the fused state ops, and a commit graph that replays them.

Commit strategy (c) of speculative decoding (REFERENCE.md section 4) for exports whose linear layers are
``com.microsoft::LinearAttention`` and ``CausalConvWithState`` (onnxruntime-genai builder, mobius default):
onnxruntime 1.32's ``state_window`` attribute, which would make those ops emit per-token states, is
CUDA-only (the CPU kernels refuse it), so on CPU the verify forward instead exports the ops' per-token
inputs, and a small weightless *commit graph* re-runs only the state ops over the accepted prefix, from
the states saved before the verify. It costs one tiny onnxruntime run instead of a replay of the model.

Rewrite rules of :func:`capture_fused_inputs`, for each state pair (past, present) whose present is,
through Identity nodes, output 1 of one of these ops with ``past`` as its input 3:

1. ``LinearAttention``: each non-empty data input other than the state (query 0, key 1, value 2, decay 4,
   beta 5) becomes a graph output as it is (no node is added; a graph input or initializer gets an
   ``Identity`` named ``{present}.capture.{slot}``).
2. ``CausalConvWithState`` (``ndim`` 1, no CUDA-only extended attributes): input 0 becomes a graph
   output the same way. Its sequence axis is 1 with ``channels_last = 1``, else 2.
3. The capture outputs are appended after the graph's outputs; nothing else changes.

:func:`commit_graph` and :func:`conv_state_after` then commit a prefix of ``kept`` tokens:

4. ``LinearAttention`` states: a graph of the captured ops (same attributes) whose inputs are each op's past
   state and its captures cut to their first ``kept`` tokens (axis 1); the ops' presents are its outputs
   (their attention outputs are dropped). Same kernel, same inputs as a replay of the kept tokens.
5. Conv states: the last L columns of ``Concat(past, input[..., :kept])`` on the sequence axis, L the
   state's extent there: the copy the op itself makes, so it is bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from onnxgen.graph.state_window import Names, expose, producers, source_of

MS = "com.microsoft"
_LA_SLOTS = {0: "query", 1: "key", 2: "value", 4: "decay", 5: "beta"}
_CONV_EXTENDED = ("state_update_capacity", "state_length", "input_channel_offset", "input_channels")


@dataclass(frozen=True)
class CapturedOp:
    """One fused state op whose inputs the verify forward exports."""

    op_type: str  # LinearAttention | CausalConvWithState
    state_input: str
    state_output: str
    captures: dict[int, str]  # op input slot -> capture graph output
    attributes: tuple[onnx.AttributeProto, ...] = ()
    seq_axis: int = 1  # of the captures (conv: of the input and the state)


@dataclass
class CaptureResult:
    captured: list[CapturedOp] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def covers(self, state_outputs: list[str]) -> bool:
        done = {c.state_output for c in self.captured}
        return all(name in done for name in state_outputs)


def capture_fused_inputs(
    model: onnx.ModelProto, states: Sequence[tuple[str, str]]
) -> tuple[onnx.ModelProto, CaptureResult]:
    """Apply rules 1-3 to a copy of ``model``; returns the model (``model`` itself if nothing applied)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = Names(out)
    prods = producers(g)
    result = CaptureResult()
    for past, present in states:
        op, why = state_op(g, past, present, prods)
        if op is None:
            result.skipped[present] = why
            continue
        slots = _LA_SLOTS if op.op_type == "LinearAttention" else {0: "input"}
        captures: dict[int, str] = {}
        for slot, label in slots.items():
            if slot < len(op.input) and op.input[slot]:
                captures[slot] = expose(g, op.input[slot], prods, names, f"{present}.capture.{label}")
        attrs = {a.name: a for a in op.attribute}
        seq_axis = 1
        if op.op_type == "CausalConvWithState":
            last = "channels_last" in attrs and attrs["channels_last"].i == 1
            seq_axis = 1 if last else 2
        result.captured.append(CapturedOp(op.op_type, past, present, captures, tuple(op.attribute), seq_axis))
    return (out if result.captured else model), result


def state_op(
    g: onnx.GraphProto, past: str, present: str, prods: dict[str, onnx.NodeProto]
) -> tuple[onnx.NodeProto | None, str]:
    """The fused op whose output 1 is ``present`` (through Identity nodes) and whose input 3 is ``past``."""
    src, why = source_of(g, present, prods)
    node = prods.get(src)
    if why or node is None:
        return None, why or f"{present!r} is not made by a node"
    if node.domain != MS or node.op_type not in ("LinearAttention", "CausalConvWithState"):
        return None, f"{present!r} comes from {node.op_type} node {node.name!r}, not a fused state op"
    where = f"{node.op_type} node {node.name!r} making {present!r}"
    if list(node.output).index(src) != 1 or len(node.input) < 4 or node.input[3] != past:
        return None, f"{where}: the state is not its output 1 fed back from input 3 ({past!r})"
    attrs = {a.name: a for a in node.attribute}
    if "state_window" in attrs and attrs["state_window"].i:
        return None, f"{where} already has state_window={attrs['state_window'].i}"
    if node.op_type == "CausalConvWithState":
        if "ndim" in attrs and attrs["ndim"].i != 1:
            return None, f"{where} has ndim={attrs['ndim'].i}; only 1-D causal convs are supported"
        extended = [n for n in _CONV_EXTENDED if n in attrs and attrs[n].i]
        if extended or ("state_channels_last" in attrs and attrs["state_channels_last"].i != -1):
            return None, f"{where} uses CUDA-only extended attributes {extended or ['state_channels_last']}"
    return node, ""


def commit_graph(
    captured: Sequence[CapturedOp], ports: Mapping[str, tuple[int, Sequence[int | str | None]]], opset: int
) -> onnx.ModelProto:
    """Rule 4: the weightless graph that re-runs the captured ``LinearAttention`` ops.

    Its inputs are each op's past state and captures, which the caller feeds cut to the kept tokens; its
    outputs are the ops' present states. ``ports`` gives the ONNX element type and shape of every state
    input and capture (as the verify session reports them). Conv states need no graph (rule 5,
    :func:`conv_state_after`).
    """
    nodes: list[onnx.NodeProto] = []
    inputs: list[onnx.ValueInfoProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    for i, op in enumerate(c for c in captured if c.op_type == "LinearAttention"):
        dtype, shape = ports[op.state_input]
        inputs.append(helper.make_tensor_value_info(op.state_input, dtype, list(shape)))
        inputs += [helper.make_tensor_value_info(c, *ports[c]) for c in op.captures.values()]
        outputs.append(helper.make_tensor_value_info(op.state_output, dtype, list(shape)))
        args = [op.captures.get(slot, "") for slot in range(6)]
        args[3] = op.state_input
        while not args[-1]:
            args.pop()
        node = helper.make_node(
            "LinearAttention", args, [f"onnxgen_dropped_{i}", op.state_output], domain=MS, name=f"la_{i}"
        )
        node.attribute.extend(op.attributes)
        nodes.append(node)
    graph = helper.make_graph(nodes, "onnxgen_state_commit", inputs, outputs)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def conv_state_after(past: np.ndarray, inputs: np.ndarray, kept: int, axis: int, out: np.ndarray) -> None:
    """Rule 5: write into ``out`` the conv state after the first ``kept`` columns of ``inputs`` (the captured
    conv input): the last L columns of ``Concat(past, inputs[..., :kept])`` on ``axis``, as the op keeps them."""
    length = past.shape[axis]
    carry = max(length - kept, 0)  # columns that still come from the past state

    def cut(a: np.ndarray, start: int, stop: int) -> np.ndarray:
        index: list[slice] = [slice(None)] * a.ndim
        index[axis] = slice(start, stop)
        return a[tuple(index)]

    np.copyto(cut(out, 0, carry), cut(past, length - carry, length))
    np.copyto(cut(out, carry, length), cut(inputs, kept - (length - carry), kept))
