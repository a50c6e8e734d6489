"""What the ONNX graph itself says: its ports, its ops (incl. function bodies and subgraphs).

Everything here reads a ``ModelProto`` loaded without weights; nothing touches tensor data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import onnx
from onnx import helper

from onnxgen.model.io import Dim, Port

MS_DOMAIN = "com.microsoft"


def _dim(d: onnx.TensorShapeProto.Dimension) -> Dim:
    if d.HasField("dim_value"):
        return int(d.dim_value)
    if d.HasField("dim_param"):
        return d.dim_param
    return None


def _dtype_name(elem_type: int) -> str:
    if elem_type == onnx.TensorProto.UNDEFINED:
        return "undefined"
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return onnx.TensorProto.DataType.Name(elem_type).lower()


def port_of(vi: onnx.ValueInfoProto) -> Port:
    """The :class:`Port` of one graph input/output (non-tensor types get dtype ``"undefined"``)."""
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        return Port(vi.name, "undefined", (), rank_known=False)
    if not tt.HasField("shape"):
        return Port(vi.name, _dtype_name(tt.elem_type), (), rank_known=False)
    return Port(vi.name, _dtype_name(tt.elem_type), tuple(_dim(d) for d in tt.shape.dim))


@dataclass(frozen=True)
class GraphSignature:
    """The ports of the main graph, in graph order (initializer-backed inputs left out)."""

    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]

    def input(self, name: str) -> Port | None:
        return next((p for p in self.inputs if p.name == name), None)

    def output(self, name: str) -> Port | None:
        return next((p for p in self.outputs if p.name == name), None)


def signature(model: onnx.ModelProto) -> GraphSignature:
    inits = {t.name for t in model.graph.initializer}
    inputs = tuple(port_of(vi) for vi in model.graph.input if vi.name not in inits)
    return GraphSignature(inputs, tuple(port_of(vi) for vi in model.graph.output))


# -- walking every node ------------------------------------------------------------------------------
def _subgraph_nodes(node: onnx.NodeProto) -> Iterator[onnx.NodeProto]:
    for attr in node.attribute:
        graphs = list(attr.graphs)
        if attr.HasField("g"):
            graphs.append(attr.g)
        for g in graphs:
            yield from walk_nodes(g.node)


def walk_nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """Every node in ``nodes`` and, recursively, in the subgraphs of their attributes (Scan, Loop, If)."""
    for node in nodes:
        yield node
        yield from _subgraph_nodes(node)


def all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Nodes of the main graph, of its subgraphs and of every model-local function body (each once)."""
    yield from walk_nodes(model.graph.node)
    for fn in model.functions:
        yield from walk_nodes(fn.node)


def local_functions(model: onnx.ModelProto) -> set[tuple[str, str]]:
    return {(f.domain, f.name) for f in model.functions}


def op_counts(model: onnx.ModelProto) -> dict[str, dict[str, int]]:
    """``{domain: {op_type: count}}`` over :func:`all_nodes` (the default domain is ``"ai.onnx"``).

    A call of a model-local function is counted under its domain like any op; the nodes of its body
    are counted once per function definition.
    """
    counts: dict[str, Counter[str]] = {}
    for node in all_nodes(model):
        counts.setdefault(node.domain or "ai.onnx", Counter())[node.op_type] += 1
    return {d: dict(sorted(c.items())) for d, c in sorted(counts.items())}


def has_op(model: onnx.ModelProto, op_type: str, domain: str = "", *, real_only: bool = True) -> bool:
    """Whether any node (anywhere) is ``domain::op_type``; ``real_only`` skips calls of local functions."""
    funcs = local_functions(model) if real_only else set()
    for node in all_nodes(model):
        if node.op_type == op_type and (node.domain or "") == domain and (domain, op_type) not in funcs:
            return True
    return False


def consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """Main-graph nodes that read each value name."""
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            if name:
                out.setdefault(name, []).append(node)
    return out


def opset_version(model: onnx.ModelProto, domain: str = "") -> int | None:
    return next((o.version for o in model.opset_import if (o.domain or "") == domain), None)
