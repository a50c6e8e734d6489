"""Pass: compute logits only for the last N positions, N fed at run time.

A prefill needs the logits of one position, but exports compute them for every prompt position: on a
512-token prompt with a 32k vocabulary the lm_head alone is a quarter of the prefill's work. This pass
adds a graph input ``onnxgen_logits_to_keep`` (int64, shape [1]) and slices the hidden state that feeds
the lm_head to its last N positions, so one graph serves prefill (N = 1), decode (N = 1) and
speculative verify (N = draft length + 1).

Rewrite rules:
1. Find the node that produces the logits output, walking back through single-data-input
   elementwise nodes (Cast, Identity, Tanh, Mul/Div/Add by a constant: softcapping, scaling).
2. That node must be the lm_head: ``MatMul``, ``com.microsoft::MatMulNBits`` or ``FusedMatMul``; its
   data input (input 0) is the hidden state [batch, seq, hidden].
3. Insert ``Slice(hidden, starts=-N, ends=INT64_MAX, axes=[1])`` and feed the lm_head from it; other
   consumers of the hidden state are untouched.
4. Run the last layer's position-wise tail (output projection, residual adds, norms, MLP) on the last
   ``max(N, 2)`` rows only (:mod:`onnxgen.graph.kept_rows`; the same output bits).
5. Add the graph input; rename the logits output's sequence axis to ``logits_to_keep``.
Preconditions are reported by name (the result's report) when the pass does not apply.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxgen.graph.kept_rows import keep_tail_rows
from onnxgen.graph.passes import PassResult

LOGITS_TO_KEEP = "onnxgen_logits_to_keep"

_PASS_THROUGH = {"Cast", "Identity", "Tanh", "Mul", "Div", "Add", "Softcap"}
_LM_HEAD = {("", "MatMul"), ("com.microsoft", "MatMulNBits"), ("com.microsoft", "FusedMatMul")}
_INT64_MAX = 2**63 - 1


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def _constant_names(graph: onnx.GraphProto) -> set[str]:
    names = {init.name for init in graph.initializer}
    names.update(out for node in graph.node if node.op_type == "Constant" for out in node.output)
    return names


def find_lm_head(graph: onnx.GraphProto, logits: str) -> tuple[onnx.NodeProto | None, str]:
    """The lm_head node feeding ``logits`` (rules 1-2), or None and why not."""
    producers = _producers(graph)
    constants = _constant_names(graph)
    name = logits
    for _ in range(8):
        node = producers.get(name)
        if node is None:
            return None, f"no node produces {name!r}"
        if (node.domain or "", node.op_type) in _LM_HEAD:
            return node, ""
        dynamic = [i for i in node.input if i and i not in constants]
        if node.op_type not in _PASS_THROUGH or len(dynamic) != 1:
            return None, f"logits come from {node.op_type} node {node.name!r}, not a MatMul lm_head"
        name = dynamic[0]
    return None, "no lm_head MatMul within 8 nodes of the logits output"


def keep_last_logits(model: onnx.ModelProto, logits: str, tail_rows: bool = True) -> PassResult[str]:
    """Apply the pass to a copy of ``model``; the report says why not where it does not apply (else "").
    ``tail_rows=False`` leaves out rule 4 (the slice stays right before the lm_head)."""
    graph = model.graph
    if any(i.name == LOGITS_TO_KEEP for i in graph.input):
        return PassResult(model, False, f"the graph already has an input {LOGITS_TO_KEEP!r}")
    if not any(o.name == logits for o in graph.output):
        return PassResult(model, False, f"the graph has no output {logits!r}")
    head, reason = find_lm_head(graph, logits)
    if head is None:
        return PassResult(model, False, reason)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    head = next(n for n in g.node if list(n.output) == list(head.output))
    hidden = head.input[0]
    neg, sliced = "onnxgen_logits_to_keep_neg", "onnxgen_lm_head_input_kept"
    g.initializer.extend(
        [
            helper.make_tensor("onnxgen_slice_end", TensorProto.INT64, [1], [_INT64_MAX]),
            helper.make_tensor("onnxgen_slice_axis", TensorProto.INT64, [1], [1]),
        ]
    )
    nodes = [
        helper.make_node("Neg", [LOGITS_TO_KEEP], [neg], name="onnxgen_logits_to_keep/Neg"),
        helper.make_node(
            "Slice",
            [hidden, neg, "onnxgen_slice_end", "onnxgen_slice_axis"],
            [sliced],
            name="onnxgen_logits_to_keep/Slice",
        ),
    ]
    index = list(g.node).index(head)
    for offset, node in enumerate(nodes):
        g.node.insert(index + offset, node)
    head.input[0] = sliced
    g.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    if tail_rows:
        keep_tail_rows(g, nodes[1], LOGITS_TO_KEEP)
    for o in g.output:
        if (
            o.name == logits
            and o.type.tensor_type.HasField("shape")
            and len(o.type.tensor_type.shape.dim) == 3
        ):
            dim = o.type.tensor_type.shape.dim[1]
            dim.Clear()
            dim.dim_param = "logits_to_keep"
    return PassResult(out, True, "")
