"""Serial attention for verify forwards: a forward of exactly ``width`` tokens computes each position's
attention as its own single-token ``GroupQueryAttention`` call, the bits a decode step computes.

onnxruntime's CPU attention multiplies the probabilities by V with a single-row SGEMM kernel when a call has
one query row and with the blocked kernel otherwise, so a multi-token verify's rows differ from the decode
steps they stand for in the last bits (:mod:`onnxgen.runtime.verify_check`). Every other node of a decoder
computes a row alike whatever the row count where ``MatMulNBits`` quantizes activations to int8, so running
only the attention position by position makes a verify exact while its projections (the weights, most of
the cost) stay one multi-row forward.

Rewrite rules, for each ``GroupQueryAttention`` whose KV cache is written in place (past and present bound
to one buffer), with no inputs past ``sin_cache``:

1. The node becomes an ``If`` on ``tokens == width`` (``tokens``: the token input's sequence extent,
   computed once). The else branch is the node as it was, so prefill, decode steps and verifies of other
   widths compute what they computed before (plus the cost of one ``If`` per layer).
2. The then branch slices the query (and key, value where not packed) into ``width`` single positions and
   runs one call each, in order, each with ``seqlens_k`` and ``total_sequence_length`` lowered to that
   position's (a Shape of the previous call's output orders them); the outputs are concatenated.
3. Every call writes its position's key and value into the cache in place: call ``s`` has its own present
   outputs, surfaced as extra ``If`` and graph outputs named ``<present>.serial<s>`` (the last call's are the
   node's own). A verify binds them to the KV cache buffers; the else branch gives them empty tensors,
   which forwards that do not bind them never fetch.

The report lists the rewritten nodes, the alias outputs of each present output, and the nodes left (why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgen.graph.passes import PassResult

MS = "com.microsoft"
ALIAS = "{}.serial{}"
EMPTY = "serial_attention/empty"
_MAX_INPUTS = 9  # query, key, value, past key, past value, seqlens_k, total_sequence_length, cos, sin


@dataclass
class SerialAttention:
    """What :func:`serialize_attention` did."""

    width: int = 0
    rewritten: list[str] = field(default_factory=list)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # present output -> per-position aliases
    skipped: dict[str, str] = field(default_factory=dict)


def serialize_attention(model: onnx.ModelProto, token_input: str, width: int) -> PassResult[SerialAttention]:
    """``model`` with every eligible ``GroupQueryAttention`` run position by position in forwards of exactly
    ``width`` tokens (module docstring); ``token_input`` names the ``[batch, tokens]`` id input."""
    if width < 2:
        raise ValueError(f"width must be >= 2 (got {width})")
    report = SerialAttention(width=width)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input}
    candidates = []
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != MS:
            continue
        name = node.name or node.output[0]
        why = _ineligible(node, inputs, outputs)
        if why:
            report.skipped[name] = why
        else:
            candidates.append(node)
    if not candidates:
        return PassResult(model, False, report)
    cond = "serial_attention/is_verify"
    head = [
        helper.make_node("Shape", [token_input], ["serial_attention/shape"], start=1, end=2),
        helper.make_node(
            "Equal", ["serial_attention/shape", "serial_attention/width"], ["serial_attention/eq"]
        ),
        helper.make_node("Squeeze", ["serial_attention/eq"], [cond]),
    ]
    graph.initializer.append(numpy_helper.from_array(np.array([width], np.int64), "serial_attention/width"))
    # the element type of each present output (a graph output), float where it is not declared
    declared = {o.name: o.type.tensor_type.elem_type or TensorProto.FLOAT for o in graph.output}
    dtype = helper.tensor_dtype_to_np_dtype(declared[candidates[0].output[1]])
    graph.initializer.append(numpy_helper.from_array(np.zeros((0,), dtype), EMPTY))
    rewritten: dict[int, onnx.NodeProto] = {}
    for node in candidates:
        rewritten[id(node)] = _if_node(node, cond, width, report)
    nodes = list(head)
    for node in graph.node:
        nodes.append(rewritten.get(id(node), node))
    del graph.node[:]
    graph.node.extend(nodes)
    for present, aliases in report.aliases.items():
        for alias in aliases:
            graph.output.append(helper.make_tensor_value_info(alias, declared[present], None))
    return PassResult(out, True, report)


def _ineligible(node: onnx.NodeProto, inputs: set[str], outputs: set[str]) -> str:
    if any(name for name in node.input[_MAX_INPUTS:]):
        return "it takes position ids, an attention bias or head sinks"
    if len(node.output) < 3 or not all(node.output[1:3]):
        return "it has no present key and value outputs"
    if not (node.input[3] in inputs and node.input[4] in inputs and set(node.output[1:3]) <= outputs):
        return "its KV cache is not a graph input and output pair"
    return ""


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _if_node(node: onnx.NodeProto, cond: str, width: int, report: SerialAttention) -> onnx.NodeProto:
    """The ``If`` that replaces ``node``: serial calls when the forward has ``width`` tokens, else ``node``."""
    tag = (node.name or node.output[0]).replace("/", "_")
    q, k, v, past_k, past_v, seqlens, total = (list(node.input) + [""] * 7)[:7]
    rest = list(node.input[7:_MAX_INPUTS])
    out, present_k, present_v = node.output[:3]
    attrs = list(node.attribute)
    aliases_k = [ALIAS.format(present_k, s) for s in range(width - 1)]
    aliases_v = [ALIAS.format(present_v, s) for s in range(width - 1)]
    report.aliases[present_k], report.aliases[present_v] = aliases_k, aliases_v
    report.rewritten.append(node.name or out)

    then_nodes: list[onnx.NodeProto] = []
    pieces, keys, values = [], [], []
    order = ""  # an int32 zero computed from the previous call's output: orders the calls
    for s in range(width):
        p = f"{tag}/s{s}"
        then_nodes += [
            _const(f"{p}/start", np.array([s], np.int64)),
            _const(f"{p}/end", np.array([s + 1], np.int64)),
            _const(f"{p}/axis", np.array([1], np.int64)),
        ]
        sliced = []
        for role, source in (("q", q), ("k", k), ("v", v)):
            if not source:
                sliced.append("")
                continue
            then_nodes.append(
                helper.make_node("Slice", [source, f"{p}/start", f"{p}/end", f"{p}/axis"], [f"{p}/{role}"])
            )
            sliced.append(f"{p}/{role}")
        back = width - 1 - s
        seq_s, total_s = seqlens, total
        if back or order:
            then_nodes.append(_const(f"{p}/back", np.array(back, np.int32)))
            lowered = f"{p}/back"
            if order:
                then_nodes.append(helper.make_node("Add", [lowered, order], [f"{p}/back_after"]))
                lowered = f"{p}/back_after"
            then_nodes += [
                helper.make_node("Sub", [seqlens, lowered], [f"{p}/seqlens"]),
                helper.make_node("Sub", [total, lowered], [f"{p}/total"]),
            ]
            seq_s, total_s = f"{p}/seqlens", f"{p}/total"
        last = s == width - 1
        keys.append(f"{p}/present_k" if not last else f"{tag}/present_k")
        values.append(f"{p}/present_v" if not last else f"{tag}/present_v")
        call = helper.make_node(
            "GroupQueryAttention",
            [*sliced, past_k, past_v, seq_s, total_s, *rest],
            [f"{p}/out", keys[-1], values[-1]],
            name=f"{tag}/serial{s}",
            domain=MS,
        )
        call.attribute.extend(attrs)
        then_nodes.append(call)
        pieces.append(f"{p}/out")
        if not last:  # zero, from this call's output: the next call runs after this one wrote the cache
            then_nodes += [
                helper.make_node("Shape", [f"{p}/out"], [f"{p}/shape"], start=0, end=1),
                helper.make_node("Cast", [f"{p}/shape"], [f"{p}/shape32"], to=TensorProto.INT32),
                _const(f"{p}/zero", np.array([0], np.int32)),
                helper.make_node("Mul", [f"{p}/shape32", f"{p}/zero"], [f"{p}/order"]),
            ]
            order = f"{p}/order"
    then_nodes.append(helper.make_node("Concat", pieces, [f"{tag}/out"], axis=1))
    then_outputs = [f"{tag}/out", keys[-1], values[-1], *keys[:-1], *values[:-1]]

    kept = onnx.NodeProto()
    kept.CopyFrom(node)
    kept.output[:] = [f"{tag}/else_out", f"{tag}/else_k", f"{tag}/else_v"]
    # the per-position outputs of a forward of another width: one empty tensor (of the parent graph, through
    # the one Identity onnxruntime asks for), returned for each of them
    else_nodes = [kept, helper.make_node("Identity", [EMPTY], [f"{tag}/else_empty"])]
    else_outputs = [
        f"{tag}/else_out",
        f"{tag}/else_k",
        f"{tag}/else_v",
        *[f"{tag}/else_empty"] * (2 * (width - 1)),
    ]

    def branch(name: str, nodes: list[onnx.NodeProto], outs: list[str]) -> onnx.GraphProto:
        return helper.make_graph(nodes, name, [], [onnx.ValueInfoProto(name=o) for o in outs])

    return helper.make_node(
        "If",
        [cond],
        [out, present_k, present_v, *aliases_k, *aliases_v],
        name=f"{tag}/serial_if",
        then_branch=branch(f"{tag}_serial", then_nodes, then_outputs),
        else_branch=branch(f"{tag}_as_exported", else_nodes, else_outputs),
    )
