"""Op counts reach into Scan bodies and model-local function bodies; the family label follows the ops."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import helper
from sigbuild import base_inputs, logits_port, sig_model, write_package

from onnxgen.model import ModelPackage
from onnxgen.model.graph_ports import op_counts
from onnxgen.model.inspect import describe, layer_list

F = onnx.TensorProto.FLOAT


def _scan_node(inp: str, out: str) -> onnx.NodeProto:
    body = helper.make_graph(
        [helper.make_node("Softplus", ["x_t"], ["y_t"]), helper.make_node("Identity", ["s"], ["s_out"])],
        "body",
        [helper.make_tensor_value_info("s", F, [4]), helper.make_tensor_value_info("x_t", F, [4])],
        [helper.make_tensor_value_info("s_out", F, [4]), helper.make_tensor_value_info("y_t", F, [4])],
    )
    return helper.make_node("Scan", ["state0", inp], ["state_fin", out], body=body, num_scan_inputs=1)


def _state_model(
    nodes: list[onnx.NodeProto], functions: Sequence[onnx.FunctionProto] = ()
) -> onnx.ModelProto:
    model = sig_model(
        [*base_inputs(), ("past.0.recurrent", "float32", ["batch", 4, 8, 8])],
        [logits_port(), ("present.0.recurrent", "float32", ["batch", 4, 8, 8])],
        nodes,
    )
    model.functions.extend(functions)
    model.opset_import.append(helper.make_opsetid("pkg.local", 1))
    return model


def test_op_counts_include_scan_bodies(tmp_path: Path) -> None:
    model = _state_model([_scan_node("xs", "ys")])
    counts = op_counts(model)
    assert counts["ai.onnx"]["Scan"] == 1
    assert counts["ai.onnx"]["Softplus"] == 1  # inside the Scan body
    pkg = ModelPackage.open(write_package(tmp_path, model))
    assert describe(pkg)["family"] == "hybrid (ONNX Scan)"


def test_op_counts_include_function_bodies_and_label_scan_inside_functions(tmp_path: Path) -> None:
    fn = helper.make_function(
        "pkg.local",
        "LinearAttention",
        ["xs"],
        ["ys"],
        [_scan_node("xs", "ys")],
        [helper.make_opsetid("", 21)],
    )
    call = helper.make_node("LinearAttention", ["x"], ["y"], domain="pkg.local")
    model = _state_model([call], [fn])
    counts = op_counts(model)
    assert counts["pkg.local"] == {"LinearAttention": 1}
    assert counts["ai.onnx"]["Scan"] == 1 and counts["ai.onnx"]["Softplus"] == 1
    pkg = ModelPackage.open(write_package(tmp_path, model))
    summary = describe(pkg)
    assert summary["family"] == "hybrid (ONNX Scan in model-local functions)"
    assert summary["functions"] == ["pkg.local::LinearAttention"]


def test_a_local_function_called_linear_attention_is_not_the_contrib_op(tmp_path: Path) -> None:
    fn = helper.make_function(
        "com.microsoft",
        "LinearAttention",
        ["a"],
        ["b"],
        [helper.make_node("Identity", ["a"], ["b"])],
        [helper.make_opsetid("", 21)],
    )
    model = _state_model([helper.make_node("LinearAttention", ["x"], ["y"], domain="com.microsoft")], [fn])
    assert (
        describe(ModelPackage.open(write_package(tmp_path, model)))["family"]
        == "hybrid (model-local functions)"
    )


def test_layer_lists_are_compact() -> None:
    assert layer_list(list(range(3, 64, 4))) == "3..63 step 4"
    assert layer_list([0, 1, 2]) == "0..2"
    assert layer_list([0, 2]) == "0, 2"
    assert layer_list([i for i in range(64) if i % 4 != 3]) == "0, 1, 2, 4, 5, 6, ..., 62 (48 layers)"
