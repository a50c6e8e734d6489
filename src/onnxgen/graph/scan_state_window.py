"""Pass: make a Scan-based export emit every recurrent state after each position of a forward.

This is commit strategy (b) of speculative decoding (docs/speculative-commit.md) for exports whose linear
layers are a Concat + Conv + Slice causal conv and an ONNX ``Scan`` over the sequence axis (mobius
``--ep onnx-standard``, ``onnxgen.testing`` family ``hybrid-scan``). The verify forward then leaves the
state after every token in an extra output, and committing to an accepted prefix is one copy per state.

Rewrite rules, for each state pair (past input, present output), the present traced back through Identity
nodes to the node that makes it:

1. Recurrent state: the present is state output i of a default-domain ``Scan`` of the main graph. The body
   gets ``Identity(S'_i)`` as a new last body output, and the Scan a matching new last output
   ``{present}.per_position`` scanned on axis 0 (0 is appended to ``scan_output_axes`` and
   ``scan_output_directions`` when the Scan carries them). Layout ``rows``: ``[T, *state_shape]``, row i is
   the state after token i, bit-identical to the final state of a Scan over the first i + 1 tokens.
2. Conv state: the present is ``Slice(c, starts=[-L], ends=[to the end], axes=[a])`` (steps absent or
   ``[1]``) of ``c = Concat(past, x, axis=a)``. ``c`` itself becomes a graph output (no node is added).
   Layout ``window`` along a: the state after token i is ``c[..., i+1 : i+1+L]``.
3. The per-position outputs are appended after the graph's outputs; no existing input, output or node
   changes, so the rewritten graph still answers every ordinary forward exactly as before.

A state matching neither rule is left alone and reported in ``skipped`` with the rule it failed.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxgen.graph.passes import PassResult
from onnxgen.graph.state_window import (
    Names,
    PerPosition,
    StateWindowReport,
    add_output,
    attribute,
    constant_ints,
    expose,
    input_rank,
    output_info,
    per_position_name,
    producers,
    source_of,
)

_TO_THE_END = 2**31 - 1  # a Slice end at or past this reaches the end of any real axis


def emit_scan_states(
    model: onnx.ModelProto, states: Sequence[tuple[str, str]]
) -> PassResult[StateWindowReport]:
    """Apply the pass to a copy of ``model`` for the ``(past, present)`` port pairs in ``states``: the
    model (``model`` itself when nothing applied) and what was done."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = Names(out)
    result = StateWindowReport([], {})
    for past, present in states:
        prods = producers(g)
        src, why = source_of(g, present, prods)
        node = prods.get(src)
        if why or node is None:
            result.skipped[present] = why or f"{present!r} is not made by a node"
            continue
        if node.op_type == "Scan" and node.domain in ("", "ai.onnx"):
            done, why = _scan_rows(g, node, src, past, present, names)
        elif node.op_type == "Slice" and node.domain in ("", "ai.onnx"):
            done, why = _conv_window(g, node, past, present, prods, names)
        else:
            done, why = (
                None,
                f"{present!r} comes from {node.op_type} node {node.name!r}, not a Scan or a Slice",
            )
        if done is None:
            result.skipped[present] = why
        else:
            result.per_position.append(done)
    return PassResult(out if result.modified else model, result.modified, result)


def _scan_rows(
    g: onnx.GraphProto, scan: onnx.NodeProto, src: str, past: str, present: str, names: Names
) -> tuple[PerPosition | None, str]:
    """Rule 1."""
    body_attr, m_attr = attribute(scan, "body"), attribute(scan, "num_scan_inputs")
    if body_attr is None or m_attr is None:
        return None, f"Scan {scan.name!r} has no body or num_scan_inputs (Scan-8 and older are not supported)"
    n_states = len(scan.input) - m_attr.i
    index = list(scan.output).index(src)
    if index >= n_states:
        return None, f"{present!r} is scan output {index} of Scan {scan.name!r}, not one of its states"
    body = body_attr.g
    row = names.fresh(f"{body.name or 'scan_body'}/{present}/per_position")
    body.node.append(helper.make_node("Identity", [body.output[index].name], [row], name=names.fresh(row)))
    info = onnx.ValueInfoProto(name=row)
    info.type.CopyFrom(body.output[index].type)
    body.output.append(info)
    for name in ("scan_output_axes", "scan_output_directions"):
        attr = attribute(scan, name)
        if attr is not None:
            attr.ints.append(0)
    output = per_position_name(present)
    scan.output.append(output)
    add_output(g, output, output_info(g, present), "verify_tokens")
    return PerPosition(past, present, output, "rows"), ""


def _conv_window(
    g: onnx.GraphProto,
    sl: onnx.NodeProto,
    past: str,
    present: str,
    prods: dict[str, onnx.NodeProto],
    names: Names,
) -> tuple[PerPosition | None, str]:
    """Rule 2."""
    where = f"Slice {sl.name!r} making {present!r}"
    concat = prods.get(sl.input[0])
    if concat is None or concat.op_type != "Concat" or not concat.input or concat.input[0] != past:
        return None, f"{where} does not slice a Concat whose first input is {past!r}"
    axis_attr = attribute(concat, "axis")
    rank = input_rank(g, past)
    axis = _normal(axis_attr.i if axis_attr is not None else 0, rank)
    args = [constant_ints(g, n, prods) if n else None for n in (*sl.input[1:], "", "", "")[:4]]
    starts, ends, axes, steps = args
    if starts is None or len(starts) != 1 or starts[0] >= 0:
        return None, f"{where} does not start at a constant negative offset -L"
    if ends is None or ends[0] < _TO_THE_END:
        return None, f"{where} does not run to the end of the axis"
    if axes is None or len(axes) != 1 or _normal(axes[0], rank) != axis:
        return None, f"{where} does not slice the Concat axis {axis}"
    if len(sl.input) > 4 and sl.input[4] and steps != [1]:
        return None, f"{where} has steps other than 1"
    output = expose(g, concat.output[0], prods, names, per_position_name(present))
    return PerPosition(past, present, output, "window", axis), ""


def _normal(axis: int, rank: int | None) -> int:
    return axis + rank if axis < 0 and rank is not None else axis
