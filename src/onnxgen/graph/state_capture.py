"""Pass: export the per-token inputs of the state-updating nodes, and a commit graph that replays them.

Commit strategy (c) of speculative decoding (docs/speculative-commit.md), for every export family. The verify
forward additionally returns the inputs of the nodes that update the recurrent states (values the forward
computes anyway), and committing to an accepted prefix re-runs only those nodes over the kept tokens, from
the states saved before the verify: a small weightless *commit graph* for the recurrences, a host copy for
the conv windows. That costs one small onnxruntime run instead of a replay of the whole model and, unlike
per-position state outputs (:mod:`onnxgen.graph.scan_state_window`), adds no memory that grows as the state
size times the tokens of a forward, so one session serves prefill, decode and verify.

Rewrite rules of :func:`capture_state_inputs`, for each state pair (past, present), the present traced back
through Identity nodes to the node that makes it:

1. ``com.microsoft::LinearAttention`` writing the state as output 1 from input 3 (``past``), no
   ``state_window``: a *replay* node; its data inputs query 0, key 1, value 2, decay 4, beta 5 are captured,
   tokens on axis 1.
2. A default-domain ``Scan`` writing the state as state output i from state input i (``past``): a *replay*
   node; its scan inputs are captured, tokens on their ``scan_input_axes``. Every state of the Scan must be a
   state pair, no scan input may run in reverse, and its body may hold no control flow and may read from the
   outer graph only initializers stored inline (they are copied into the commit graph).
3. ``com.microsoft::CausalConvWithState`` writing the state as output 1 from input 3 (``ndim`` 1, no
   ``state_window`` or CUDA-only extended attributes): a *window*; input 0 is captured, tokens on axis 1
   with ``channels_last = 1``, else 2.
4. ``Slice(Concat(past, x, axis=a), starts=[-L], ends=[to the end], axes=[a])``: a *window*; ``x`` is
   captured, tokens on axis a.
5. Captured values become graph outputs as they are (no node runs for them; a graph input or initializer
   gets an ``Identity`` named ``{present}.capture.{slot}``). Nothing else changes.

Committing ``kept`` of the verified tokens (:func:`commit_graph`, :func:`conv_state_after`):

6. Each replay node is copied into the commit graph: state inputs bound to the past ports, captures to
   inputs that the caller feeds cut to their first ``kept`` tokens, state outputs named as the present
   ports, every other output dropped. Same kernels and inputs as a replay of the kept tokens.
7. A window state is the last L columns of ``Concat(past, x[..., :kept])``, the copy the op itself makes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from onnxgen.graph.passes import PassResult
from onnxgen.graph.state_window import (
    Names,
    attribute,
    constant_ints,
    expose,
    input_rank,
    producers,
    source_of,
)

MS = "com.microsoft"
_LA_SLOTS = (0, 1, 2, 4, 5)
_CONV_EXTENDED = ("state_update_capacity", "state_length", "input_channel_offset", "input_channels")
_TO_THE_END = 2**31 - 1


@dataclass
class WindowState:
    """A conv state: the last L columns of the past state and the captured new columns (rules 3-4)."""

    past: str
    present: str
    capture: str  # the value (then the graph output) holding the new columns
    axis: int


@dataclass
class ReplayNode:
    """A node re-run over the kept tokens in the commit graph (rules 1-2)."""

    node: onnx.NodeProto  # a copy
    states: dict[int, tuple[int, str, str]] = field(
        default_factory=dict
    )  # in slot -> (out slot, past, present)
    token_axes: dict[int, int] = field(default_factory=dict)  # captured input slot -> token axis
    captures: dict[int, str] = field(default_factory=dict)  # captured input slot -> graph output
    initializers: list[onnx.TensorProto] = field(default_factory=list)  # outer constants its body reads


@dataclass
class CaptureReport:
    windows: list[WindowState] = field(default_factory=list)
    replays: list[ReplayNode] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def presents(self) -> set[str]:
        return {w.present for w in self.windows} | {s[2] for r in self.replays for s in r.states.values()}

    def covers(self, state_outputs: list[str]) -> bool:
        return set(state_outputs) <= self.presents


def capture_state_inputs(
    model: onnx.ModelProto, states: Sequence[tuple[str, str]]
) -> PassResult[CaptureReport]:
    """Apply rules 1-5 to a copy of ``model``; the result's model is ``model`` itself if nothing applied."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    prods = producers(g)
    result = CaptureReport()
    replays: dict[tuple[str, ...], ReplayNode] = {}
    for past, present in states:
        why = _add_state(g, prods, past, present, result, replays)
        if why:
            result.skipped[present] = why
    result.replays = [r for r in replays.values() if _all_states_paired(r, result)]
    names = Names(out)
    for w in result.windows:
        w.capture = expose(g, w.capture, prods, names, f"{w.present}.capture")
    for r in result.replays:
        label = next(iter(r.states.values()))[2]
        for slot in r.token_axes:
            r.captures[slot] = expose(g, r.node.input[slot], prods, names, f"{label}.capture.{slot}")
    return PassResult(out if result.presents else model, bool(result.presents), result)


def _add_state(
    g: onnx.GraphProto,
    prods: dict[str, onnx.NodeProto],
    past: str,
    present: str,
    result: CaptureReport,
    replays: dict[tuple[str, ...], ReplayNode],
) -> str:
    """Match one state pair to rules 1-4 and record it; returns why it does not match ("" when it does)."""
    src, why = source_of(g, present, prods)
    node = prods.get(src)
    if why or node is None:
        return why or f"{present!r} is not made by a node"
    slot = list(node.output).index(src)
    where = f"{node.op_type} node {node.name!r} making {present!r}"
    if node.op_type in ("CausalConvWithState", "Slice"):
        window, why = _window(g, node, slot, past, present, prods)
        if window is None:
            return f"{where}: {why}"
        result.windows.append(window)
        return ""
    key = tuple(node.output)
    replay = replays.get(key)
    if replay is None:
        replay, why = _replay(g, node)
        if replay is None:
            return f"{where}: {why}"
        replays[key] = replay
    state_in = slot if node.op_type == "Scan" else 3
    fed_back = state_in < len(node.input) and node.input[state_in] == past
    if not fed_back or (node.op_type != "Scan" and slot != 1):
        return f"{where}: the state is not fed back from {past!r}"
    replay.states[state_in] = (slot, past, present)
    return ""


def _all_states_paired(replay: ReplayNode, result: CaptureReport) -> bool:
    if replay.node.op_type != "Scan":
        return bool(replay.states)
    n_states = len(replay.node.input) - attribute(replay.node, "num_scan_inputs").i  # type: ignore[union-attr]
    missing = [replay.node.input[i] for i in range(n_states) if i not in replay.states]
    for _, _, present in replay.states.values():
        if missing:
            result.skipped[present] = (
                f"Scan {replay.node.name!r} also carries {missing}, which are not state pairs"
            )
    return not missing and bool(replay.states)


def _window(
    g: onnx.GraphProto,
    node: onnx.NodeProto,
    slot: int,
    past: str,
    present: str,
    prods: dict[str, onnx.NodeProto],
) -> tuple[WindowState | None, str]:
    """Rules 3-4."""
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "CausalConvWithState":
        if node.domain != MS or slot != 1 or len(node.input) < 4 or node.input[3] != past:
            return None, f"the state is not its output 1 fed back from input 3 ({past!r})"
        if "ndim" in attrs and attrs["ndim"].i != 1:
            return None, f"ndim={attrs['ndim'].i}; only 1-D causal convs are supported"
        extended = [n for n in (*_CONV_EXTENDED, "state_window") if n in attrs and attrs[n].i]
        if extended or ("state_channels_last" in attrs and attrs["state_channels_last"].i != -1):
            return None, f"it sets {extended or ['state_channels_last']} (CUDA-only or windowed layouts)"
        last = "channels_last" in attrs and attrs["channels_last"].i == 1
        return WindowState(past, present, node.input[0], 1 if last else 2), ""
    concat = prods.get(node.input[0])
    if (
        concat is None
        or concat.op_type != "Concat"
        or list(concat.input[:1]) != [past]
        or len(concat.input) != 2
    ):
        return None, f"it does not slice a two-input Concat whose first input is {past!r}"
    rank = input_rank(g, past)
    concat_axis = attribute(concat, "axis")
    axis = _normal(concat_axis.i if concat_axis is not None else 0, rank)
    starts, ends, axes, steps = (
        constant_ints(g, n, prods) if n else None for n in (*node.input[1:], "", "", "")[:4]
    )
    if starts is None or len(starts) != 1 or starts[0] >= 0:
        return None, "it does not start at a constant negative offset -L"
    if ends is None or ends[0] < _TO_THE_END:
        return None, "it does not run to the end of the axis"
    if axes is None or len(axes) != 1 or _normal(axes[0], rank) != axis:
        return None, f"it does not slice the Concat axis {axis}"
    if len(node.input) > 4 and node.input[4] and steps != [1]:
        return None, "it has steps other than 1"
    return WindowState(past, present, concat.input[1], axis), ""


def _normal(axis: int, rank: int | None) -> int:
    return axis + rank if axis < 0 and rank is not None else axis


def _replay(g: onnx.GraphProto, node: onnx.NodeProto) -> tuple[ReplayNode | None, str]:
    """Rules 1-2 (the node's own checks; the state slots are checked by the caller)."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    if node.op_type == "LinearAttention" and node.domain == MS:
        window = attribute(node, "state_window")
        if window is not None and window.i:
            return None, f"it already has state_window={window.i}"
        return ReplayNode(
            copy, token_axes={s: 1 for s in _LA_SLOTS if s < len(node.input) and node.input[s]}
        ), ""
    if node.op_type != "Scan" or node.domain not in ("", "ai.onnx"):
        return None, "not a LinearAttention, Scan, CausalConvWithState or Concat window"
    body, m = attribute(node, "body"), attribute(node, "num_scan_inputs")
    if body is None or m is None:
        return None, "a Scan without body or num_scan_inputs (Scan-8 is not supported)"
    n_states = len(node.input) - m.i
    directions = attribute(node, "scan_input_directions")
    if directions is not None and any(directions.ints):
        return None, "a scan input runs in reverse"
    graph_attrs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(a.type in graph_attrs for n in body.g.node for a in n.attribute):
        return None, "its body holds control flow"
    inits, why = _outer_constants(g, body.g)
    if why:
        return None, why
    axes_attr = attribute(node, "scan_input_axes")
    axes = list(axes_attr.ints) if axes_attr is not None else [0] * m.i
    return ReplayNode(copy, token_axes={n_states + j: axes[j] for j in range(m.i)}, initializers=inits), ""


def _outer_constants(g: onnx.GraphProto, body: onnx.GraphProto) -> tuple[list[onnx.TensorProto], str]:
    """The main-graph initializers a body reads, or why it reads something else from the outer graph."""
    defined = {i.name for i in body.input} | {t.name for t in body.initializer}
    defined |= {o for n in body.node for o in n.output}
    free = {i for n in body.node for i in n.input if i and i not in defined}
    inits = {t.name: t for t in g.initializer}
    found = []
    for name in sorted(free):
        t = inits.get(name)
        if t is None or t.data_location == onnx.TensorProto.EXTERNAL:
            return [], f"its body reads {name!r} from the outer graph, which is not an inline initializer"
        found.append(t)
    return found, ""


def commit_graph(
    replays: Sequence[ReplayNode],
    ports: Mapping[str, tuple[int, Sequence[int | str | None]]],
    model: onnx.ModelProto,
) -> onnx.ModelProto:
    """Rule 6: the commit graph re-running ``replays``; ``ports`` gives the ONNX element type and shape of
    every past port and capture (as the verify session reports them), ``model`` the opsets to import."""
    nodes: list[onnx.NodeProto] = []
    inputs: list[onnx.ValueInfoProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    inits: list[onnx.TensorProto] = []
    for i, r in enumerate(replays):
        node = onnx.NodeProto()
        node.CopyFrom(r.node)
        for slot, (_, past, _) in r.states.items():
            node.input[slot] = past
            inputs.append(helper.make_tensor_value_info(past, *ports[past]))
        for slot, name in r.captures.items():
            node.input[slot] = name
            inputs.append(helper.make_tensor_value_info(name, *ports[name]))
        presents = {out_slot: present for out_slot, _, present in r.states.values()}
        for k in range(len(node.output)):
            node.output[k] = presents.get(k, f"onnxgen_dropped_{i}_{k}" if node.output[k] else "")
        for _, past, present in r.states.values():
            outputs.append(helper.make_tensor_value_info(present, *ports[past]))
        nodes.append(node)
        inits += [t for t in r.initializers if all(t.name != x.name for x in inits)]
    graph = helper.make_graph(nodes, "onnxgen_state_commit", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version or 10)


def cut_tokens(array: np.ndarray, axis: int, kept: int) -> np.ndarray:
    """``array`` cut to its first ``kept`` entries on ``axis`` (a view)."""
    index: list[slice] = [slice(None)] * array.ndim
    index[axis] = slice(0, kept)
    return array[tuple(index)]


def conv_state_after(past: np.ndarray, new: np.ndarray, kept: int, axis: int, out: np.ndarray) -> None:
    """Rule 7: write into ``out`` the window state after the first ``kept`` columns of ``new`` (the captured
    input): the last L columns of ``Concat(past, new[..., :kept])`` on ``axis``, as the op keeps them."""
    length = past.shape[axis]
    carry = max(length - kept, 0)  # columns that still come from the past state

    def cut(a: np.ndarray, start: int, stop: int) -> np.ndarray:
        index: list[slice] = [slice(None)] * a.ndim
        index[axis] = slice(start, stop)
        return a[tuple(index)]

    np.copyto(cut(out, 0, carry), cut(past, length - carry, length))
    np.copyto(cut(out, carry, length), cut(new, kept - (length - carry), kept))
