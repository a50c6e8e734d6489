"""Part of the logits-to-keep pass: run the last layer's position-wise tail on the kept rows only.

:mod:`onnxgen.graph.logits_to_keep` slices the hidden state right before the lm_head, but what produces
that hidden state after the last attention (or linear attention) is position-wise too: the gate on the
attention output, the output projection, the residual adds and norms, the MLP. Each output row of these
nodes depends on the same row of their inputs alone, so on a prompt only the kept rows need them: on a
512-token prompt that is the last layer's output projection and MLP for 510 rows fewer, a few percent of
a prefill. :func:`keep_tail_rows` moves the slice up to where the tail's inputs come from nodes that mix
positions (or feed other consumers): each such input is sliced to its last ``max(N, 2)`` rows, and the
lm_head's slice then keeps the last ``N`` of those.

Why at least 2 rows: onnxruntime's ``MatMulNBits`` computes a single row on another kernel (a matrix-vector
product, summed in another order) than two or more rows, whose rows each come out bit for bit as in a
longer matrix (tests check both). With at least 2 rows a prompt's tail gives the very bits it gave over
every row, and a decode step (one row) runs as before.

A node belongs to the tail when it is position-wise by the rules of :func:`_position_wise` and every
consumer of each of its outputs is in the tail (or is the lm_head's slice); graph outputs (an exposed hidden
state, which holds every position) keep their producers out of it.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxgen.model.graph_ports import walk_nodes

# unary or broadcasting elementwise ops (by domain): an output element depends on the same element of the
# inputs (constants broadcast along the last axis only, checked by _Constants.row_constant)
_ELEMENTWISE = {
    "": {"Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "Cast", "Identity", "Neg", "Erf", "Softplus"},
    "com.microsoft": {"QuickGelu", "FastGelu", "Gelu", "BiasGelu"},
}
_LAST_AXIS_NORMS = {
    ("", "SimplifiedLayerNormalization"),
    ("", "LayerNormalization"),
    ("", "RMSNormalization"),
}
_SKIP_NORMS = {
    ("com.microsoft", "SkipSimplifiedLayerNormalization"),
    ("com.microsoft", "SkipLayerNormalization"),
}
# producers whose outputs the tail's inputs may be sliced from (_boundary)
_BOUNDARIES = {
    ("com.microsoft", "GroupQueryAttention"),
    ("com.microsoft", "MultiHeadAttention"),
    ("com.microsoft", "LinearAttention"),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"),
    ("com.microsoft", "SkipLayerNormalization"),
    ("", "Split"),
}


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _key(node: onnx.NodeProto) -> tuple[str, ...]:
    """A node's identity: its outputs (value names are unique in a graph)."""
    return tuple(node.output)


def _axis(node: onnx.NodeProto, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == "axis"), default)


class _Constants:
    """The graph's constant values (initializers, Constant nodes) and their shapes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.dims: dict[str, list[int]] = {t.name: list(t.dims) for t in graph.initializer}
        self.ints: dict[str, list[int]] = {}
        for t in graph.initializer:
            if (
                t.data_type == TensorProto.INT64
                and t.data_location != TensorProto.EXTERNAL
                and len(t.dims) <= 1
            ):
                self.ints[t.name] = [int(v) for v in onnx.numpy_helper.to_array(t).reshape(-1)]
        for node in graph.node:
            if node.op_type == "Constant" and _domain(node) == "" and node.output:
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.dims[node.output[0]] = list(value.dims)
                    if value.data_type == TensorProto.INT64 and len(value.dims) <= 1:
                        self.ints[node.output[0]] = [
                            int(v) for v in onnx.numpy_helper.to_array(value).reshape(-1)
                        ]

    def __contains__(self, name: str) -> bool:
        return name in self.dims

    def row_constant(self, name: str) -> bool:
        """A constant that broadcasts along the last axis only (every leading dimension is 1)."""
        dims = self.dims.get(name)
        return dims is not None and all(d == 1 for d in dims[:-1])


def _position_wise(node: onnx.NodeProto, const: _Constants) -> bool:
    """Whether each output row (axis 1 of ``[batch, seq, ...]``) of ``node`` depends on the same row of its
    sequence-shaped inputs alone, with every other input a constant that does not span positions."""
    key = (_domain(node), node.op_type)
    inputs = [i for i in node.input if i]
    if node.op_type in _ELEMENTWISE.get(key[0], ()):
        return all(i not in const or const.row_constant(i) for i in inputs)
    if key == ("com.microsoft", "MatMulNBits"):  # weights, scales, zero points, bias: all constant
        return inputs[0] not in const and all(i in const for i in inputs[1:])
    if key == ("", "MatMul"):
        return len(inputs) == 2 and inputs[0] not in const and len(const.dims.get(inputs[1], [])) == 2
    if key in _LAST_AXIS_NORMS:
        return _axis(node, -1) == -1 and inputs[0] not in const and all(i in const for i in inputs[1:])
    if key in _SKIP_NORMS:  # normalize the last axis; input and skip are the data, the rest weights
        return len(inputs) >= 3 and all(i in const for i in inputs[2:])
    if key == ("", "Split"):
        return _axis(node, 0) == -1 or _axis(node, 0) >= 2
    if key == ("", "Reshape"):  # [0, 0, ...] keeps batch and positions where they were
        shape = const.ints.get(node.input[1]) if len(node.input) > 1 else None
        allowzero = next((a.i for a in node.attribute if a.name == "allowzero"), 0)
        return shape is not None and len(shape) >= 3 and shape[:2] == [0, 0] and not allowzero
    return False


def _boundary(node: onnx.NodeProto) -> bool:
    """Whether a tail input made by ``node`` may be sliced: the output of a fused op that onnxruntime's
    optimizer does not fuse further with what follows (an attention, a linear attention, a skip norm's
    residual sum) or of data movement. A slice between two nodes that the optimizer would fuse (a
    decomposed RMSNorm's ``Sqrt`` and ``Div``) would keep it from fusing them and change the rounding; graph
    inputs are not known to be ``[batch, seq, ...]``."""
    return (_domain(node), node.op_type) in _BOUNDARIES


def tail_nodes(graph: onnx.GraphProto, kept: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The position-wise tail whose rows only ``kept`` (the lm_head's slice) reads (module docstring),
    found by one walk back over the topologically sorted nodes."""
    const = _Constants(graph)
    users = _users(graph)
    outputs = {o.name for o in graph.output}
    tail = {_key(kept)}
    found = []
    for node in reversed(graph.node):
        if _key(node) in tail or not node.output or not _position_wise(node, const):
            continue
        uses = [(out, u) for out in node.output if out for u in users.get(out, [])]
        if not uses or any(out in outputs for out in node.output):
            continue
        # the slice's data input alone: its starts are the kept count, which the tail must not slice
        if all(_key(u) in tail and (_key(u) != _key(kept) or out == kept.input[0]) for out, u in uses):
            tail.add(_key(node))
            found.append(node)
    return found


def _users(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """The main graph's nodes reading each value; a value read inside a node's subgraphs (Scan, Loop, If
    bodies) counts as read by that node."""
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        names = set(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                names.update(i for n in walk_nodes(sub.node) for i in n.input)
        for name in names - {""}:
            out.setdefault(name, []).append(node)
    return out


def keep_tail_rows(graph: onnx.GraphProto, kept: onnx.NodeProto, keep_input: str) -> int:
    """Slice the inputs of the tail above ``kept`` (the lm_head's Slice, in ``graph``) to their last
    ``max(keep_input, 2)`` rows, in place; returns the number of tail nodes that now run on those rows."""
    tail = tail_nodes(graph, kept)
    if not tail:
        return 0
    const = _Constants(graph)
    inside = {out for node in tail for out in node.output if out}
    entering = {i for node in tail for i in node.input if i and i not in inside and i not in const}
    made_by = {out: node for node in graph.node for out in node.output if out}
    if not all(name in made_by and _boundary(made_by[name]) for name in entering):
        return 0
    rows, neg = "onnxgen_tail_rows", "onnxgen_tail_rows_neg"
    graph.initializer.append(helper.make_tensor("onnxgen_tail_min_rows", TensorProto.INT64, [1], [2]))
    made = [
        helper.make_node("Max", [keep_input, "onnxgen_tail_min_rows"], [rows], name="onnxgen_tail/Max"),
        helper.make_node("Neg", [rows], [neg], name="onnxgen_tail/Neg"),
    ]
    sliced: dict[str, str] = {}
    for node in tail:
        for i, name in enumerate(node.input):
            if name not in entering:
                continue
            if name not in sliced:
                sliced[name] = f"{name}/onnxgen_tail_rows"
                made.append(
                    helper.make_node(
                        "Slice",
                        [name, neg, "onnxgen_slice_end", "onnxgen_slice_axis"],
                        [sliced[name]],
                        name=f"onnxgen_tail/Slice_{len(sliced)}",
                    )
                )
            node.input[i] = sliced[name]
    keys = {_key(n) for n in tail}
    first = next(i for i, n in enumerate(graph.node) if _key(n) in keys)
    for offset, node in enumerate(made):
        graph.node.insert(first + offset, node)
    return len(tail)
