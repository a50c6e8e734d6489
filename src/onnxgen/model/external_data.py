"""External data: checks that every file a model references exists and is long enough (no data read),
and reading one tensor's values from its file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxgen.errors import ModelPackageError

# attribute types that hold tensors or graphs (an untyped attribute is looked into too)
_HOLDERS = frozenset(
    (
        onnx.AttributeProto.TENSOR,
        onnx.AttributeProto.TENSORS,
        onnx.AttributeProto.GRAPH,
        onnx.AttributeProto.GRAPHS,
        onnx.AttributeProto.UNDEFINED,
    )
)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        # most nodes' attributes are numbers or strings: skipped on their type alone
        if any(attr.type in _HOLDERS for attr in node.attribute):
            yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for g in attr.graphs:
            yield from _graph_tensors(g)


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model (main graph, subgraphs, function bodies) stored outside the file."""
    tensors = [*_graph_tensors(model.graph)]
    for fn in model.functions:
        for node in fn.node:
            tensors.extend(_node_tensors(node))
    return (t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL)


def check_external_data(model: onnx.ModelProto, model_path: Path) -> list[Path]:
    """The external-data files ``model`` needs; raises :class:`ModelPackageError` naming a file that is
    missing, or too short for the tensor ranges recorded in the graph (a truncated copy)."""
    ends: dict[str, tuple[int, str]] = {}  # by location as written (one Path per file, made below)
    for t in external_tensors(model):
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        if not location:
            raise ModelPackageError(
                f"{model_path}: tensor '{t.name}' is external but names no file; re-export"
            )
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        if end > ends.get(location, (-1, ""))[0]:
            ends[location] = (end, t.name)
    needed: dict[Path, tuple[int, str]] = {}
    for location, (end, tensor) in ends.items():
        path = model_path.parent / location
        if end > needed.get(path, (-1, ""))[0]:  # two spellings of one file: the furthest end
            needed[path] = (end, tensor)
    for path, (end, tensor) in needed.items():
        if not path.is_file():
            raise ModelPackageError(
                f"external data file {path} (weights of {model_path.name}, e.g. tensor '{tensor}') is missing; "
                f"copy it next to {model_path.name}"
            )
        size = path.stat().st_size
        if size < end:
            raise ModelPackageError(
                f"external data file {path} is truncated: {size} bytes, but tensor '{tensor}' ends at byte "
                f"{end}; re-copy the file"
            )
    return sorted(needed)


def location_of(tensor: onnx.TensorProto) -> str:
    """The file an external tensor is stored in, relative to its model's folder ("" when inline)."""
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def safe_location(location: str) -> PurePosixPath:
    """``location`` as a relative path that stays inside the model's folder (the ONNX rule for external
    data, which onnxruntime enforces too); raises :class:`ModelPackageError` for any other."""
    path = PurePosixPath(location.replace("\\", "/"))
    if not location or path.is_absolute() or ".." in path.parts or ":" in path.parts[0]:
        raise ModelPackageError(
            f"external data location {location!r} is not a relative path inside the model's folder; "
            "re-export the model with its data files beside model.onnx"
        )
    return path


def read_array(tensor: onnx.TensorProto, base_dir: Path | None) -> np.ndarray:
    """The values of ``tensor``, read from its file under ``base_dir`` when external; ``tensor`` itself is
    left as it is (``numpy_helper.to_array`` would load the data into it)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    if base_dir is None:
        raise ValueError(f"tensor {tensor.name!r} is stored outside the graph; its model's folder is needed")
    info = {e.key: e.value for e in tensor.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
    path = base_dir / safe_location(info.get("location", ""))
    data = np.fromfile(path, dtype=dtype, count=count, offset=int(info.get("offset", 0) or 0))
    return data.reshape(tuple(tensor.dims))
