"""Inline single-trip Scans: splice a Scan body into its parent graph as one iteration.

At decode the sequence axis a recurrent layer scans has extent 1, so the Scan runs its body once; onnxruntime
still pays a sub-session execution per Scan per step. This pass rewrites each eligible Scan of the main
graph into the body's own nodes. The rewritten model is only equivalent to the original when every scan
input has extent 1 on its scan axis: run it only for single-token steps.

Rewrite rules, for an eligible ``Scan(s_1..s_N, x_1..x_M) -> (s'_1..s'_N, y_1..y_K)`` with body
``(S_1..S_N, X_1..X_M) -> (S'_1..S'_N, Y_1..Y_K)``:

1. Each state formal ``S_i`` is bound to the Scan's state input ``s_i`` (no node).
2. Each scan formal ``X_j`` is bound to ``Squeeze(x_j, axis_j)``, ``axis_j`` the j-th ``scan_input_axes``
   entry (default 0; negative axes keep their meaning). Opset >= 13 passes the axes as an int64
   initializer, older opsets as the ``axes`` attribute.
3. Body initializers become parent initializers; body nodes move into the parent graph, in body order,
   just before the Scan; every name the body defines (values, initializers, nodes) gets a name unused
   anywhere in the model, subgraphs included.
4. Each final state ``S'_i`` takes the name (and declared type and shape) of the Scan output ``s'_i``.
5. Each scan output ``Y_k`` becomes ``Unsqueeze(Y_k, axis_k)`` named as the Scan output ``y_k``, ``axis_k``
   the k-th ``scan_output_axes`` entry (default 0).
6. A body output that is not produced by a moved body node (a state passed through unchanged, a scan
   input passed through, a promoted initializer, an outer-scope value) or that is listed twice gets an
   ``Identity`` first, so every Scan output keeps its own producer.
7. The Scan node is removed. Graph input and output names, their order and declared types stay as they were.

Directions (``scan_input_directions``, ``scan_output_directions``) do not matter for one iteration: a
reversed extent-1 axis is the same tensor.

Eligibility (a Scan failing any rule is left alone; :func:`scan_eligibility` names the rule):

- ``domain``: a default-domain Scan of opset >= 9 (Scan-8 has a batch axis and sequence lengths);
- ``state``: at least one state variable;
- ``arity``: the body has N+M inputs and N+K outputs and the axes/directions attributes have M and K entries;
- ``static-extent``: no scan input whose declared shape gives its scan axis a static extent > 1;
- ``control-flow``: no node of the body carries a graph attribute (If, Loop, Scan, ...);
- ``captures``: every outer-scope value the body reads is a main-graph input or initializer or is produced
  by a main-graph node placed before the Scan.

Only the main graph is rewritten: Scans inside functions or inside other subgraphs are left alone.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from onnxgen.graph.passes import PassResult

SCAN_MIN_OPSET = 9
AXES_AS_INPUT_OPSET = 13


@dataclass(frozen=True)
class ScanInlines:
    """The pass's report: the Scans it inlined and the ones it left alone, with the rule each failed."""

    inlined: list[str]
    skipped: dict[str, str]


@dataclass
class ScanInlineResult(ir.passes.PassResult):
    """The onnx-ir pass's result: the model, whether it changed, and the Scans inlined and left."""

    inlined: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def report(self) -> ScanInlines:
        return ScanInlines(self.inlined, self.skipped)


class InlineSingleTripScansPass(ir.passes.InPlacePass):
    """Splice every eligible Scan of the main graph into it as a single iteration (see module doc)."""

    def call(self, model: ir.Model) -> ScanInlineResult:
        graph = model.graph
        opset = model.opset_imports.get("", 0)
        names = _NameSource(model)
        result = ScanInlineResult(model, modified=False)
        for index, node in enumerate(list(graph)):
            if node.op_type != "Scan":
                continue
            label = node.name or f"Scan#{index}"
            reason = scan_eligibility(node, graph, opset)
            if reason is not None:
                result.skipped[label] = reason
                continue
            _Splice(graph, node, opset, names).run()
            result.inlined.append(label)
            result.modified = True
        return result


def inline_single_trip_scans(model: ir.Model | onnx.ModelProto) -> ScanInlineResult | PassResult[ScanInlines]:
    """Run :class:`InlineSingleTripScansPass`: an ``ir.Model`` is rewritten in place (onnx-ir's result); an
    ``onnx.ModelProto`` is left untouched and the result holds a new proto (:func:`inline_scans_in_proto`).
    """
    if isinstance(model, onnx.ModelProto):
        return inline_scans_in_proto(model)
    return InlineSingleTripScansPass()(model)  # type: ignore[return-value]


def inline_scans_in_proto(model: onnx.ModelProto) -> PassResult[ScanInlines]:
    """The pass on a proto, weights not loaded: a new proto and what the pass did.

    Initializers keep their external-data entries exactly as given, including keys onnx_ir does not
    carry (onnxruntime's ``prepacked_*`` entries of an optimized model), so the result reads the same
    data file at the same offsets.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Ignoring unknown external data key")
        result = InlineSingleTripScansPass()(ir.serde.deserialize_model(model))
        out = ir.serde.serialize_model(result.model)
    entries = {t.name: t.external_data for t in model.graph.initializer if t.external_data}
    for t in out.graph.initializer:
        original = entries.get(t.name)
        if original is not None and list(t.external_data) != list(original):
            del t.external_data[:]
            t.external_data.extend(original)
    return PassResult(out, result.modified, result.report)  # type: ignore[attr-defined]


def find_inlinable_scans(model: ir.Model) -> tuple[list[str], dict[str, str]]:
    """The main-graph Scans the pass would inline, and the others with the rule each fails (no rewrite)."""
    opset = model.opset_imports.get("", 0)
    inlinable: list[str] = []
    skipped: dict[str, str] = {}
    for index, node in enumerate(model.graph):
        if node.op_type == "Scan":
            label = node.name or f"Scan#{index}"
            reason = scan_eligibility(node, model.graph, opset)
            if reason is None:
                inlinable.append(label)
            else:
                skipped[label] = reason
    return inlinable, skipped


# -- eligibility --------------------------------------------------------------------------------------


def scan_eligibility(node: ir.Node, graph: ir.Graph, opset: int) -> str | None:
    """``None`` when ``node`` (a Scan of ``graph``) can be inlined, else ``"rule: why"``."""
    if node.domain not in ("", "ai.onnx") or opset < SCAN_MIN_OPSET:
        return f"domain: needs a default-domain Scan of opset >= {SCAN_MIN_OPSET} (domain {node.domain!r}, opset {opset})"
    body_attr = node.attributes.get("body")
    if body_attr is None or body_attr.type != ir.AttributeType.GRAPH:
        return "arity: the Scan has no body graph"
    body = body_attr.as_graph()
    m = node.attributes.get_int("num_scan_inputs", 0)
    n = len(node.inputs) - m
    k = len(node.outputs) - n
    if n < 1:
        return "state: the Scan carries no state variable"
    if m < 0 or k < 0 or len(body.inputs) != n + m or len(body.outputs) != n + k:
        return (
            f"arity: body has {len(body.inputs)} inputs / {len(body.outputs)} outputs for a node with "
            f"{n} states, {m} scan inputs and {max(k, 0)} scan outputs"
        )
    for attr, count in (
        ("scan_input_axes", m),
        ("scan_input_directions", m),
        ("scan_output_axes", k),
        ("scan_output_directions", k),
    ):
        values = node.attributes.get_ints(attr)
        if values is not None and len(values) != count:
            return f"arity: {attr} has {len(values)} entries for {count} scan tensors"
    inputs = [v for v in node.inputs if v is not None]
    if len(inputs) < len(node.inputs):
        return "arity: the Scan has an empty input"
    axes = _axes(node, "scan_input_axes", m)
    for j, (value, axis) in enumerate(zip(inputs[n:], axes, strict=True)):
        extent = _static_extent(value, axis)
        if extent is not None and extent > 1:
            return f"static-extent: scan input {j} ({value.name}) has extent {extent} on scan axis {axis}"
    for inner in body:
        if any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in inner.attributes.values()
        ):
            return f"control-flow: body node {inner.name or inner.op_type} ({inner.op_type}) holds a subgraph"
    return _check_captures(node, graph, body)


def _check_captures(node: ir.Node, graph: ir.Graph, body: ir.Graph) -> str | None:
    position = {n: i for i, n in enumerate(graph)}
    scan_at = position[node]
    for value in _captured(body):
        if value.graph is graph and (value.is_graph_input() or value.is_initializer()):
            continue
        producer = value.producer()
        if producer is not None and producer.graph is graph and position[producer] < scan_at:
            continue
        return (
            f"captures: the body reads {value.name!r}, which the main graph does not define before the Scan"
        )
    return None


def _captured(body: ir.Graph) -> Iterator[ir.Value]:
    """Values the body's nodes read (or it outputs) without defining them."""
    local: set[ir.Value] = set(body.inputs) | set(body.initializers.values())
    for inner in body:
        local.update(inner.outputs)
    seen: set[ir.Value] = set()
    for value in [v for inner in body for v in inner.inputs] + list(body.outputs):
        if value is not None and value not in local and value not in seen:
            seen.add(value)
            yield value


def _axes(node: ir.Node, attr: str, count: int) -> list[int]:
    values = node.attributes.get_ints(attr)
    return list(values) if values is not None else [0] * count


def _static_extent(value: ir.Value, axis: int) -> int | None:
    shape = value.shape
    if shape is None:
        return None
    rank = len(shape)
    if not -rank <= axis < rank:
        return None
    dim = shape[axis]
    return dim if isinstance(dim, int) else None


# -- the rewrite --------------------------------------------------------------------------------------


class _NameSource:
    """Fresh value and node names: a name is free when no scope of the model (main graph, functions,
    subgraphs) defines it. Names are counted per defining scope, so a body being spliced can
    :meth:`release` its own names and keep those that nothing else defines."""

    def __init__(self, model: ir.Model) -> None:
        self.values: Counter[str] = Counter()
        self.nodes: Counter[str] = Counter()
        scopes: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
        for g in scopes:
            self._count(g, 1)

    def _count(self, g: ir.Graph | ir.Function, sign: int) -> None:
        names = [v.name for v in g.inputs]
        if isinstance(g, ir.Graph):
            names.extend(g.initializers)
        for n in g:
            names.extend(v.name for v in n.outputs)
            if n.name:
                self.nodes[n.name] += sign
            for a in n.attributes.values():
                for sub in _subgraphs(a):
                    self._count(sub, sign)
        for name in names:
            if name:
                self.values[name] += sign

    def release(self, body: ir.Graph) -> None:
        """Forget the names ``body`` defines (it is about to be spliced and its names reassigned)."""
        self._count(body, -1)

    @staticmethod
    def _fresh(base: str, used: Counter[str]) -> str:
        name, k = base, 1
        while used[name] > 0:
            k += 1
            name = f"{base}__{k}"
        used[name] += 1
        return name

    def value(self, base: str) -> str:
        return self._fresh(base, self.values)

    def node(self, base: str) -> str:
        return self._fresh(base, self.nodes)


def _subgraphs(attr: ir.Attr) -> list[ir.Graph]:
    if attr.type == ir.AttributeType.GRAPH:
        return [attr.as_graph()]
    if attr.type == ir.AttributeType.GRAPHS:
        return list(attr.as_graphs())
    return []


class _Splice:
    """Rules 1-7 for one eligible Scan."""

    def __init__(self, graph: ir.Graph, scan: ir.Node, opset: int, names: _NameSource) -> None:
        self.graph = graph
        self.scan = scan
        self.opset = opset
        self.names = names
        self.body = scan.attributes["body"].as_graph()
        self.m = scan.attributes.get_int("num_scan_inputs", 0)
        self.n = len(scan.inputs) - self.m
        self.prefix = scan.name or "scan"
        self.new_nodes: list[ir.Node] = []

    def run(self) -> None:
        self.names.release(self.body)
        formals, body_outputs = list(self.body.inputs), list(self.body.outputs)
        self.body.inputs.clear()
        self.body.outputs.clear()
        moved = list(self.body)
        self.body.remove(moved)
        self._promote_initializers()
        binding = self._bind_formals(formals)  # rules 1, 2
        for inner in moved:  # rule 3
            inner.name = self.names.node(inner.name or f"{self.prefix}/{inner.op_type}")
            for v in inner.outputs:
                if v.name:
                    v.name = self.names.value(v.name)
        self.new_nodes.extend(moved)
        producers = {v for inner in moved for v in inner.outputs}
        finals = self._finals(body_outputs, binding, producers)  # rules 4-6
        self.graph.insert_before(self.scan, self.new_nodes)
        for old, new in finals:
            if old is None or not old.name:
                continue
            name, vtype, shape = old.name, old.type, old.shape
            old.name = self.names.value(f"{name}__scan")
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            new.name, new.type, new.shape = name, vtype, shape
        self.graph.remove(self.scan, safe=True)  # rule 7

    def _promote_initializers(self) -> None:
        for init in list(self.body.initializers.values()):
            self.body.initializers.pop(init.name)  # type: ignore[arg-type]
            init.name = self.names.value(init.name or f"{self.prefix}/const")
            self.graph.register_initializer(init)

    def _bind_formals(self, formals: list[ir.Value]) -> dict[ir.Value, ir.Value]:
        binding: dict[ir.Value, ir.Value] = {}
        axes = _axes(self.scan, "scan_input_axes", self.m)
        for i, formal in enumerate(formals):
            actual = self.scan.inputs[i]
            assert actual is not None  # checked by scan_eligibility
            if i >= self.n:
                actual = self._axis_op("Squeeze", actual, axes[i - self.n], formal.name or "scan_in")
                actual.type, actual.shape = formal.type, formal.shape
            formal.replace_all_uses_with(actual)
            binding[formal] = actual
        return binding

    def _finals(
        self, body_outputs: list[ir.Value], binding: dict[ir.Value, ir.Value], producers: set[ir.Value]
    ) -> list[tuple[ir.Value | None, ir.Value]]:
        axes = _axes(self.scan, "scan_output_axes", len(body_outputs) - self.n)
        claimed: set[ir.Value] = set()
        finals: list[tuple[ir.Value | None, ir.Value]] = []
        for i, formal in enumerate(body_outputs):
            value = binding.get(formal, formal)
            base = formal.name or "scan_out"
            if i >= self.n:
                value = self._axis_op("Unsqueeze", value, axes[i - self.n], base)
            elif value not in producers or value in claimed:
                value = self._single("Identity", [value], base)
            claimed.add(value)
            finals.append((self.scan.outputs[i], value))
        return finals

    def _axis_op(self, op_type: str, x: ir.Value, axis: int, base: str) -> ir.Value:
        if self.opset >= AXES_AS_INPUT_OPSET:
            axes = ir.Value(
                name=self.names.value(f"{base}__axes"),
                type=ir.TensorType(ir.DataType.INT64),
                shape=ir.Shape([1]),
                const_value=ir.tensor(np.array([axis], dtype=np.int64)),
            )
            self.graph.register_initializer(axes)
            return self._single(op_type, [x, axes], base)
        return self._single(op_type, [x], base, axes=[axis])

    def _single(self, op_type: str, inputs: list[ir.Value], base: str, **attrs: Sequence[int]) -> ir.Value:
        out = ir.Value(name=self.names.value(f"{base}__{op_type.lower()}"))
        node = ir.node(
            op_type, inputs, attributes=attrs, outputs=[out], name=self.names.node(f"{self.prefix}/{op_type}")
        )
        self.new_nodes.append(node)
        return out
