"""Pass: a verify variant of a fused export whose state ops keep the state after each of the last W tokens.

onnxruntime 1.32's ``com.microsoft::LinearAttention`` and ``CausalConvWithState`` take a ``state_window``
attribute W (1..8): past and present states gain a leading window axis of extent W, right-aligned, so slot
``W - T + i`` of the present is the state after token i of a T-token forward and slot W - 1 is the usual
present; only slot W - 1 of the past is read. Its CPU kernels refuse W > 0 ("CUDA EP only"), so onnxgen
uses this pass for CUDA sessions only and :mod:`onnxgen.graph.fused_state_capture` on CPU.

Rewrite rules, for each state pair (past, present) whose present is, through Identity nodes, output 1 of a
``com.microsoft`` ``LinearAttention`` or ``CausalConvWithState`` (``ndim`` 1) with ``past`` as its input 3:

1. The op gets ``state_window = W``.
2. Its input 3 becomes ``Expand(Unsqueeze(past, [0]), [W, 1, ..., 1])``: the graph input keeps its shape
   and every slot holds the past state (only slot W - 1 is read).
3. Its output 1 is renamed ``{present}.per_position`` and declared a graph output ``[W, *state_shape]``
   (layout ``rows``); the old name is made again by ``Gather(per_position, W - 1, axis=0)``, so the
   present port and every consumer see the same ``[*state_shape]`` tensor as before.

The rewritten graph serves ordinary forwards too (the per-position output is simply not fetched), at the
price of writing W state slots per forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from onnxgen.graph.passes import PassResult
from onnxgen.graph.state_window import (
    Names,
    PerPosition,
    StateWindowReport,
    add_output,
    default_opset,
    input_rank,
    output_info,
    per_position_name,
    producers,
    source_of,
)

MS = "com.microsoft"
MAX_STATE_WINDOW = 8  # the ops' documented range is [0, 8]


def emit_fused_state_window(
    model: onnx.ModelProto, states: Sequence[tuple[str, str]], window: int = MAX_STATE_WINDOW
) -> PassResult[StateWindowReport]:
    """Apply the pass to a copy of ``model`` with ``state_window = window``."""
    if not 1 <= window <= MAX_STATE_WINDOW:
        raise ValueError(
            f"window must be in [1, {MAX_STATE_WINDOW}] (the ops' state_window range), got {window}"
        )
    if default_opset(model) < 13:
        why = "the model's opset is below 13 (Unsqueeze axes as input)"
        return PassResult(model, False, StateWindowReport([], {p: why for _, p in states}))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = Names(out)
    result = StateWindowReport([], {})
    for past, present in states:
        prods = producers(g)
        node, why = state_op(g, past, present, prods)
        rank = input_rank(g, past)
        if node is None or rank is None:
            result.skipped[present] = why or f"the graph input {past!r} has no declared rank"
            continue
        _rewrite(g, node, past, present, window, rank, names)
        result.per_position.append(PerPosition(past, present, per_position_name(present), "rows"))
    return PassResult(out if result.modified else model, result.modified, result)


def _rewrite(
    g: onnx.GraphProto, node: onnx.NodeProto, past: str, present: str, window: int, rank: int, names: Names
) -> None:
    for attr in list(node.attribute):
        if attr.name == "state_window":
            node.attribute.remove(attr)
    node.attribute.append(helper.make_attribute("state_window", window))
    zero, shape = names.fresh(f"{past}/axis0"), names.fresh(f"{past}/window_shape")
    g.initializer.extend(
        [
            helper.make_tensor(zero, TensorProto.INT64, [1], [0]),
            helper.make_tensor(shape, TensorProto.INT64, [rank + 1], [window] + [1] * rank),
        ]
    )
    lifted, windowed = names.fresh(f"{past}/lifted"), names.fresh(f"{past}/windowed")
    last = names.fresh(f"{present}/last_slot")
    g.initializer.append(helper.make_tensor(last, TensorProto.INT64, [], [window - 1]))
    old = node.output[1]
    rows = per_position_name(present)
    node.input[3] = windowed
    node.output[1] = rows
    index = list(g.node).index(node)
    g.node.insert(index, helper.make_node("Expand", [lifted, shape], [windowed], name=windowed))
    g.node.insert(index, helper.make_node("Unsqueeze", [past, zero], [lifted], name=lifted))
    g.node.insert(index + 3, helper.make_node("Gather", [rows, last], [old], axis=0, name=names.fresh(old)))
    add_output(g, rows, output_info(g, present), window)


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
    if list(node.output).index(src) != 1 or len(node.input) < 4 or node.input[3] != past:
        return None, f"{node.op_type} node {node.name!r} does not write {present!r} from input 3 ({past!r})"
    ndim = next((a.i for a in node.attribute if a.name == "ndim"), 1)
    if ndim != 1:
        return None, f"{node.op_type} node {node.name!r} has ndim={ndim}; only 1-D causal convs are supported"
    return node, ""
