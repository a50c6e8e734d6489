"""Per-position recurrent states for speculative verify: what a rewritten graph emits, and how to read it.

A verify forward runs T tokens (the pending token, then T-1 drafts). When the target keeps only the first
``kept`` of them, every recurrent state must become the state after token ``kept - 1``. The passes beside
this module make the verify forward leave those states in extra graph outputs, so committing is one copy
per state instead of a replay:

- :mod:`onnxgen.graph.scan_state_window`: Scan-based exports (a scan output per state, a conv window);
- :mod:`onnxgen.graph.fused_state_window`: ``com.microsoft`` fused ops (``state_window`` attribute, which
  onnxruntime 1.32 implements on CUDA only).

Each per-position output has one of two layouts, both right-aligned so that the last position is the
present state itself:

- ``rows``: ``[R, *state_shape]`` with R >= T; row ``R - T + i`` is the state after token i (a Scan output
  over the tokens has R = T, a ``state_window = W`` present has R = W).
- ``window``: the state's shape with its sequence axis ``axis`` widened from L to L + T (the concat of the
  past conv state and the T new columns); the state after token i is the L columns ``[i + 1, i + 1 + L)``.

Graph helpers shared by these passes and :mod:`onnxgen.graph.state_capture` live here too (unique names,
constant lookup, producers, exposing a value as a graph output).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
from onnx import numpy_helper

PER_POSITION_SUFFIX = ".per_position"
Layout = Literal["rows", "window"]


@dataclass(frozen=True)
class PerPosition:
    """The per-position output of one recurrent state (see the module docstring for the layouts)."""

    state_input: str  # the past port, e.g. ``past.0.recurrent``
    state_output: str  # the present port, e.g. ``present.0.recurrent``
    output: str  # the per-position graph output
    layout: Layout
    axis: int = 0  # window layout: the sequence axis

    def select(self, value: np.ndarray, tokens: int, kept: int) -> np.ndarray | None:
        """The state after the first ``kept`` of the ``tokens`` tokens the forward ran (a view), or None
        when ``value`` does not reach back that far (a window of W rows shorter than the forward)."""
        if not 1 <= kept <= tokens:
            raise ValueError(f"kept must be in [1, {tokens}] (got {kept})")
        if self.layout == "rows":
            row = value.shape[0] - tokens + kept - 1
            return value[row] if row >= 0 else None
        length = value.shape[self.axis] - tokens
        index: list[slice] = [slice(None)] * value.ndim
        index[self.axis] = slice(kept, kept + length)
        return value[tuple(index)]


def per_position_name(state_output: str) -> str:
    return state_output + PER_POSITION_SUFFIX


class Names:
    """Names unused anywhere in a model (main graph and every subgraph), handed out once each."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.used: set[str] = set()
        for g in _graphs(model.graph):
            self.used.update(v.name for v in (*g.input, *g.output, *g.value_info, *g.initializer))
            for node in g.node:
                self.used.update((*node.input, *node.output, node.name))

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    """``node``'s attribute ``name``, None when it is not set."""
    return next((a for a in node.attribute if a.name == name), None)


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def source_of(graph: onnx.GraphProto, name: str, prods: dict[str, onnx.NodeProto]) -> tuple[str, str]:
    """Walk back from ``name`` through Identity nodes; returns (value name, why the walk stopped)."""
    for _ in range(16):
        node = prods.get(name)
        if node is None or node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            return name, ""
        name = node.input[0]
    return name, "a chain of more than 16 Identity nodes"


def constant_ints(graph: onnx.GraphProto, name: str, prods: dict[str, onnx.NodeProto]) -> list[int] | None:
    """The int values of an initializer or Constant node called ``name`` (None if it is not one)."""
    for init in graph.initializer:
        if init.name == name:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                return None
            return [int(v) for v in numpy_helper.to_array(init).reshape(-1)]
    node = prods.get(name)
    if node is not None and node.op_type == "Constant":
        for attr in node.attribute:
            if attr.name == "value":
                return [int(v) for v in numpy_helper.to_array(attr.t).reshape(-1)]
            if attr.name == "value_int":
                return [int(attr.i)]
            if attr.name == "value_ints":
                return [int(v) for v in attr.ints]
    return None


def expose(
    graph: onnx.GraphProto, value: str, prods: dict[str, onnx.NodeProto], names: Names, alias: str
) -> str:
    """Make the value ``value`` a graph output and return the output's name: the value itself when a node
    makes it (no extra node runs), else an ``Identity`` named ``alias`` (graph inputs, initializers)."""
    if value in prods:
        if output_info(graph, value) is None:
            add_output(graph, value, None, None)
        return value
    alias = names.fresh(alias)
    graph.node.append(onnx.helper.make_node("Identity", [value], [alias], name=alias))
    add_output(graph, alias, None, None)
    return alias


def input_rank(graph: onnx.GraphProto, name: str) -> int | None:
    """The declared rank of the graph input ``name`` (None when it has no shape or is not an input)."""
    info = next((i for i in graph.input if i.name == name), None)
    if info is None or not info.type.tensor_type.HasField("shape"):
        return None
    return len(info.type.tensor_type.shape.dim)


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def output_info(graph: onnx.GraphProto, name: str) -> onnx.ValueInfoProto | None:
    return next((o for o in graph.output if o.name == name), None)


def add_output(
    graph: onnx.GraphProto, name: str, like: onnx.ValueInfoProto | None, lead: str | int | None
) -> None:
    """Declare ``name`` a graph output typed as ``like`` (a state port), with a leading axis ``lead``
    (rows layout) or with the shape left out (window layout, or no declared type to copy)."""
    info = onnx.ValueInfoProto(name=name)
    if like is not None and like.type.HasField("tensor_type"):
        info.type.tensor_type.elem_type = like.type.tensor_type.elem_type
        if lead is not None and like.type.tensor_type.HasField("shape"):
            dims = info.type.tensor_type.shape.dim
            first = dims.add()
            if isinstance(lead, int):
                first.dim_value = lead
            else:
                first.dim_param = lead
            for d in like.type.tensor_type.shape.dim:
                dims.add().CopyFrom(d)
    graph.output.append(info)


@dataclass
class StateWindowReport:
    """What a per-position pass did: the outputs it added, and why each other state was left alone."""

    per_position: list[PerPosition]
    skipped: dict[str, str]

    @property
    def modified(self) -> bool:
        return bool(self.per_position)

    def covers(self, state_outputs: list[str]) -> bool:
        """Every one of ``state_outputs`` has a per-position output."""
        done = {p.state_output for p in self.per_position}
        return all(name in done for name in state_outputs)
