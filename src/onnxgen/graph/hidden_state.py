"""Pass: expose the decoder's final hidden state as a graph output (what an MTP head reads).

A multi-token-prediction head drafts from the target's final hidden state at each position: the output
of the final norm, which is the lm_head's input. onnxruntime-genai's builder writes that tensor as a
``hidden_states`` output when it exports an MTP head beside the decoder; other exports compute it but do
not output it. This pass makes it an output without changing any computation, so the logits stay
bit-identical.

Rewrite rules:
1. Find the lm_head feeding the logits output (:func:`onnxgen.graph.logits_to_keep.find_lm_head`: a
   ``MatMul``, ``MatMulNBits`` or ``FusedMatMul``, possibly behind elementwise pass-through nodes).
2. Its data input (input 0) is the final hidden state ``[batch, seq, hidden]``. When that value already is
   a graph output, nothing changes and its name is reported.
3. Otherwise the value is renamed to ``hidden_states`` (``onnxgen_hidden_states`` when that name is taken)
   everywhere it is read, subgraphs included, and added as a graph output typed like the logits with the
   last axis ``hidden`` (the lm_head's ``K``).
Preconditions (reported by name when the pass does not apply): the graph has the logits output, the
lm_head is found, and it is not fed through the logits-to-keep slice (the pass must run before that one,
or the output would hold only the kept rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from onnxgen.graph.logits_to_keep import LOGITS_TO_KEEP, find_lm_head
from onnxgen.graph.passes import PassResult
from onnxgen.model.graph_ports import walk_nodes

HIDDEN_STATES = "hidden_states"
FALLBACK_NAME = "onnxgen_hidden_states"


@dataclass(frozen=True)
class HiddenStateResult(PassResult[str]):
    """The pass's result (its report says why it does not apply) and the hidden-state output's name (None
    when the pass does not apply)."""

    output: str | None = None


def _hidden_size(graph: onnx.GraphProto, head: onnx.NodeProto) -> int | None:
    for a in head.attribute:
        if a.name == "K":
            return int(a.i)
    if head.op_type in ("MatMul", "FusedMatMul") and len(head.input) > 1:
        init = next((t for t in graph.initializer if t.name == head.input[1]), None)
        if init is not None and len(init.dims) == 2:
            return int(init.dims[0])
    return None


def _taken_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in (*graph.input, *graph.output, *graph.initializer)}
    for node in walk_nodes(graph.node):
        names.update(node.output)
    return names


def expose_hidden_state(model: onnx.ModelProto, logits: str) -> HiddenStateResult:
    """Apply the pass to a copy of ``model`` (weights need not be loaded)."""
    graph = model.graph
    if any(i.name == LOGITS_TO_KEEP for i in graph.input):
        return HiddenStateResult(
            model, False, output=None, report="the lm_head is already fed through the logits-to-keep slice"
        )
    logits_port = next((o for o in graph.output if o.name == logits), None)
    if logits_port is None:
        return HiddenStateResult(model, False, output=None, report=f"the graph has no output {logits!r}")
    head, reason = find_lm_head(graph, logits)
    if head is None:
        return HiddenStateResult(model, False, output=None, report=reason)
    hidden = head.input[0]
    if any(o.name == hidden for o in graph.output):
        return HiddenStateResult(model, False, output=hidden, report=f"{hidden!r} is already a graph output")
    taken = _taken_names(graph)
    name = HIDDEN_STATES if HIDDEN_STATES not in taken else FALLBACK_NAME
    if name in taken:
        return HiddenStateResult(
            model, False, output=None, report=f"the names {HIDDEN_STATES!r} and {FALLBACK_NAME!r} are taken"
        )
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for node in walk_nodes(g.node):
        for i, value in enumerate(node.input):
            if value == hidden:
                node.input[i] = name
        for i, value in enumerate(node.output):
            if value == hidden:
                node.output[i] = name
    for info in g.value_info:
        if info.name == hidden:
            info.name = name
    tensor = logits_port.type.tensor_type
    dims: list[int | str | None] = [None, None, _hidden_size(g, head)]
    if tensor.HasField("shape") and len(tensor.shape.dim) == 3:
        for axis in (0, 1):
            d = tensor.shape.dim[axis]
            dims[axis] = d.dim_value if d.HasField("dim_value") else d.dim_param or None
    dims[0] = dims[0] if dims[0] is not None else "batch_size"
    dims[1] = dims[1] if dims[1] is not None else "sequence_length"
    g.output.append(helper.make_tensor_value_info(name, tensor.elem_type, dims))
    return HiddenStateResult(out, True, "", name)


__all__ = ["FALLBACK_NAME", "HIDDEN_STATES", "HiddenStateResult", "expose_hidden_state"]
