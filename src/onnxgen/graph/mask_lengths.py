"""Check: does the attention mask only tell GroupQueryAttention how long the sequence is?

onnxruntime-genai's builder (and onnxgen's test fixtures) derive GroupQueryAttention's two length inputs
from the attention mask and use it for nothing else::

    seqlens_k             = Cast(ReduceSum(mask, axes=[1]) - 1)
    total_sequence_length = Cast(Gather(Shape(mask), 1))

For such a graph a decode step may bind one ``[1, capacity]`` mask for the whole generation, ones over
the tokens held and zeros after: ``seqlens_k`` is the same sum, and ``total_sequence_length`` becomes the
shared KV buffer's length, which onnxruntime's CPU kernel accepts for a single-token step without
changing a bit of its output (it attends over ``seqlens_k + 1`` positions; tests compare it with the
growing mask). The step then writes one mask element instead of binding a new mask each token.

:func:`mask_feeds_lengths_only` accepts a graph only when every use of the mask is one of those two
paths: a ``ReduceSum`` over axis 1 (whose value does not see the trailing zeros), or a ``Shape`` whose
value reaches nothing but GroupQueryAttention's ``total_sequence_length`` input through ``Gather``,
``Cast``, ``Squeeze`` and ``Unsqueeze``. Anything else (an additive bias built from the mask, a mask
that is a graph output, a length that sizes a ``Range``) keeps the growing mask.
"""

from __future__ import annotations

import onnx

from onnxgen.graph.state_window import attribute, constant_ints, producers
from onnxgen.model.graph_ports import consumers

_TOTAL_SEQUENCE_LENGTH = 6  # GroupQueryAttention's input index
_LENGTH_PATH = {"Gather", "Cast", "Squeeze", "Unsqueeze"}
_Users = dict[str, list[onnx.NodeProto]]


def _uses(name: str, users: _Users) -> list[tuple[onnx.NodeProto, int]]:
    """Each node that reads ``name``, with the input index it reads it at."""
    return [(node, i) for node in users.get(name, []) for i, n in enumerate(node.input) if n == name]


def _reduce_axes(graph: onnx.GraphProto, node: onnx.NodeProto) -> list[int] | None:
    """A ReduceSum's axes, from its attribute (opset < 13) or its constant second input; None unknown."""
    axes = attribute(node, "axes")
    if axes is not None:
        return list(axes.ints)
    if len(node.input) < 2 or not node.input[1]:
        return None
    return constant_ints(graph, node.input[1], producers(graph))


def _feeds_total_length_only(name: str, users: _Users, outputs: set[str]) -> bool:
    """Whether the value ``name`` (a function of the mask's shape) reaches only GroupQueryAttention's
    ``total_sequence_length``, through length-preserving ops."""
    if name in outputs:
        return False
    for node, index in _uses(name, users):
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            if index != _TOTAL_SEQUENCE_LENGTH:
                return False
        elif node.op_type in _LENGTH_PATH and node.domain in ("", "ai.onnx") and index == 0:
            if not all(_feeds_total_length_only(out, users, outputs) for out in node.output):
                return False
        else:
            return False
    return True


def mask_feeds_lengths_only(model: onnx.ModelProto, mask: str) -> bool:
    """Whether ``mask`` (an input of ``model``) only derives GroupQueryAttention's lengths (see above)."""
    graph = model.graph
    users = consumers(model)
    outputs = {o.name for o in graph.output}
    uses = _uses(mask, users)
    if not uses or mask in outputs:
        return False
    for node, index in uses:
        if node.domain not in ("", "ai.onnx") or index != 0:
            return False
        if node.op_type == "ReduceSum":
            axes = _reduce_axes(graph, node)
            if axes is None or sorted(a % 2 for a in axes) != [1]:
                return False
        elif node.op_type == "Shape":
            if not all(_feeds_total_length_only(out, users, outputs) for out in node.output):
                return False
        else:
            return False
    return True
