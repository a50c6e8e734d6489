"""check_external_data / external_tensors: tensors stored outside the file are found wherever the graph holds
them (initializers, node attributes, subgraphs), and each file is checked against the furthest byte any
tensor reads from it, however its location is spelled."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from onnxgen.errors import ModelPackageError
from onnxgen.model.external_data import check_external_data, external_tensors


def _external(name: str, location: str, offset: int, length: int) -> TensorProto:
    t = helper.make_tensor(name, TensorProto.FLOAT, [length // 4], [0.0] * (length // 4))
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _model() -> onnx.ModelProto:
    """Externals in an initializer, a Constant's tensor attribute and an If branch; nodes with number
    attributes beside them; one file named two ways."""
    branch = helper.make_graph(
        [helper.make_node("Identity", ["w_branch"], ["y"])],
        "then",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[_external("w_branch", "c.bin", 0, 64)],
    )
    nodes = [
        helper.make_node("Constant", [], ["k"], value=_external("w_const", "b.bin", 16, 32)),
        helper.make_node("Softmax", ["x"], ["s"], axis=1),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[_external("w_a", "a.bin", 0, 128), _external("w_a2", "./a.bin", 128, 256)],
    )
    return helper.make_model(graph)


def _write(folder: Path, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        (folder / name).write_bytes(b"\0" * size)


def test_every_external_tensor_is_found_in_initializers_attributes_and_subgraphs() -> None:
    names = sorted(t.name for t in external_tensors(_model()))
    assert names == ["w_a", "w_a2", "w_branch", "w_branch", "w_const"]  # the branch twice: then and else


def test_the_files_are_checked_against_the_furthest_tensor_whatever_the_spelling(tmp_path: Path) -> None:
    model_path = tmp_path / "model.onnx"
    _write(tmp_path, {"a.bin": 384, "b.bin": 48, "c.bin": 64})
    assert check_external_data(_model(), model_path) == sorted(
        tmp_path / n for n in ("a.bin", "b.bin", "c.bin")
    )
    _write(tmp_path, {"a.bin": 383})  # short of w_a2's end (named "./a.bin")
    with pytest.raises(
        ModelPackageError, match=r"a\.bin is truncated: 383 bytes, but tensor 'w_a2' ends at byte 384"
    ):
        check_external_data(_model(), model_path)
    _write(tmp_path, {"a.bin": 384, "c.bin": 10})  # only the subgraph's tensor is past the end
    with pytest.raises(ModelPackageError, match=r"c\.bin is truncated.*'w_branch'"):
        check_external_data(_model(), model_path)
    (tmp_path / "b.bin").unlink()  # only a node attribute reads it
    with pytest.raises(ModelPackageError, match=r"b\.bin .*'w_const'.* is missing"):
        check_external_data(_model(), model_path)
