"""The inline-single-trip-Scans pass: eligibility rules, rewrite forms, names, and equality on onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from scan_models import F, accumulate_body, feeds_for, op_types, run, scan_model

from onnxgen.graph.scan_inline import (
    InlineSingleTripScansPass,
    inline_scans_in_proto,
    inline_single_trip_scans,
)


def inline(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    result = InlineSingleTripScansPass()(ir.serde.deserialize_model(model))
    return ir.serde.serialize_model(result.model), result.skipped, result.inlined  # type: ignore[attr-defined]


def assert_same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    ra, rb = run(a, feeds), run(b, feeds)
    assert list(ra) == list(rb)
    for name in ra:
        assert ra[name].shape == rb[name].shape, name
        assert np.array_equal(ra[name], rb[name]), name


def test_a_single_trip_scan_becomes_its_body_and_computes_the_same_bits() -> None:
    model = scan_model(accumulate_body())
    out, skipped, inlined = inline(model)
    assert inlined == ["the_scan"] and skipped == {}
    assert "Scan" not in op_types(out)
    assert op_types(out) == ["Squeeze", "Mul", "Add", "Tanh", "Unsqueeze"]
    assert_same_outputs(model, out, feeds_for((1, 2, 3)))


def test_graph_inputs_and_outputs_keep_their_names_order_and_types() -> None:
    model = scan_model(accumulate_body())
    out, _, _ = inline(model)
    assert [i.name for i in out.graph.input] == ["s", "x"]
    assert [o.name for o in out.graph.output] == ["s_final", "ys"]
    assert [o.type for o in out.graph.output] == [o.type for o in model.graph.output]


@pytest.mark.parametrize(
    ("in_axis", "out_axis", "x_shape"),
    [(1, 2, (2, "T", 3)), (-2, -1, (2, "T", 3)), (2, 0, (2, 3, "T")), (-1, 1, (2, 3, "T"))],
)
def test_scan_axes_other_than_zero_squeeze_and_unsqueeze_the_same_axis(
    in_axis: int, out_axis: int, x_shape: tuple[int | str, ...]
) -> None:
    model = scan_model(accumulate_body(), x_shape=x_shape, in_axis=in_axis, out_axis=out_axis)
    out, _, inlined = inline(model)
    assert inlined == ["the_scan"]
    concrete = tuple(1 if d == "T" else d for d in x_shape)
    assert_same_outputs(model, out, feeds_for(concrete))  # type: ignore[arg-type]
    assert run(out, feeds_for(concrete))["ys"].shape[out_axis] == 1  # type: ignore[arg-type]


def test_reversed_scan_directions_are_handled_because_one_slice_reads_the_same_both_ways() -> None:
    model = scan_model(accumulate_body(), directions=True)
    out, _, inlined = inline(model)
    assert inlined == ["the_scan"]
    assert_same_outputs(model, out, feeds_for((1, 2, 3)))


def test_a_state_passed_through_unchanged_gets_its_own_identity() -> None:
    body = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])],
        "pass_state",
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("y", F, [2, 3])],
    )
    model = scan_model(body)
    out, _, inlined = inline(model)
    assert inlined == ["the_scan"]
    assert "Identity" in op_types(out)
    feeds = feeds_for((1, 2, 3))
    got = run(out, feeds)
    # Compared with numpy: onnxruntime 1.32's own Scan returns an unwritten buffer for such a state.
    assert np.array_equal(got["s_final"], feeds["s"])
    assert np.array_equal(got["ys"], -feeds["x"])


def test_one_body_value_output_twice_feeds_both_scan_outputs() -> None:
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "x"], ["t"])],
        "twice",
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("t", F, [2, 3]), helper.make_tensor_value_info("t", F, [2, 3])],
    )
    out, _, _ = inline(scan_model(body))
    feeds = feeds_for((1, 2, 3))
    got = run(out, feeds)
    expected = feeds["s"] + feeds["x"][0]  # numpy: onnxruntime's Scan mishandles the doubled output
    assert np.array_equal(got["s_final"], expected)
    assert np.array_equal(got["ys"], expected[None])


def test_body_names_are_renamed_when_two_scans_share_them_and_a_parent_name_collides() -> None:
    # Two Scans with identical bodies (sibling scopes may reuse names); the parent also defines "sx".
    first = helper.make_node(
        "Scan", ["s", "x"], ["s1", "y1"], name="scan_a", body=accumulate_body("a"), num_scan_inputs=1
    )
    second = helper.make_node(
        "Scan", ["s1", "x"], ["s2", "y2"], name="scan_b", body=accumulate_body("b"), num_scan_inputs=1
    )
    parent_sx = helper.make_node("Sub", ["s2", "s"], ["sx"], name="mul")
    graph = helper.make_graph(
        [first, second, parent_sx],
        "main",
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("x", F, ["T", 2, 3])],
        [
            helper.make_tensor_value_info("sx", F, [2, 3]),
            *(helper.make_tensor_value_info(n, F, ["T", 2, 3]) for n in ("y1", "y2")),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    out, _, inlined = inline(model)
    assert inlined == ["scan_a", "scan_b"]
    values = [o for n in out.graph.node for o in n.output] + [i.name for i in out.graph.initializer]
    assert len(values) == len(set(values)), "every value is defined once"
    nodes = [n.name for n in out.graph.node]
    assert len(nodes) == len(set(nodes))
    onnx.checker.check_model(out)
    assert_same_outputs(model, out, feeds_for((1, 2, 3)))


def test_body_initializers_are_promoted_and_outer_values_the_body_reads_stay_bound() -> None:
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "scale"], ["xs"]),  # body initializer
            helper.make_node("Add", ["s", "xs"], ["s2"]),
            helper.make_node("Add", ["s2", "outer_bias"], ["y"]),  # produced by a parent node
            helper.make_node("Mul", ["y", "outer_w"], ["y2"]),  # parent initializer
        ],
        "captures",
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("s2", F, [2, 3]), helper.make_tensor_value_info("y2", F, [2, 3])],
        initializer=[helper.make_tensor("scale", F, [], [3.0])],
    )
    model = scan_model(
        body,
        extra_nodes=[helper.make_node("Neg", ["s"], ["outer_bias"])],
        initializers=[helper.make_tensor("outer_w", F, [3], [0.5, 2.0, -1.0])],
    )
    out, _, inlined = inline(model)
    assert inlined == ["the_scan"]
    assert {"scale", "outer_w"} <= {i.name for i in out.graph.initializer}
    assert_same_outputs(model, out, feeds_for((1, 2, 3)))


def test_opsets_before_13_squeeze_with_an_axes_attribute() -> None:
    model = scan_model(accumulate_body(), opset=11, in_axis=0, out_axis=0)
    out, _, _ = inline(model)
    squeeze = next(n for n in out.graph.node if n.op_type == "Squeeze")
    assert [a.name for a in squeeze.attribute] == ["axes"] and len(squeeze.input) == 1
    assert_same_outputs(model, out, feeds_for((1, 2, 3)))


def test_opsets_from_13_pass_squeeze_axes_as_an_int64_initializer() -> None:
    out, _, _ = inline(scan_model(accumulate_body(), opset=13, in_axis=0, out_axis=0))
    squeeze = next(n for n in out.graph.node if n.op_type == "Squeeze")
    axes = next(i for i in out.graph.initializer if i.name == squeeze.input[1])
    assert onnx.numpy_helper.to_array(axes).tolist() == [0]


# -- eligibility: each rule rejects, and the Scan is left as it was -----------------------------------


def _body_with_if() -> onnx.GraphProto:
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["b"])],
        "br",
        [],
        [helper.make_tensor_value_info("b", F, [2, 3])],
    )
    cond = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    return helper.make_graph(
        [
            helper.make_node("If", ["cond"], ["yi"], then_branch=branch, else_branch=branch),
            helper.make_node("Add", ["s", "yi"], ["s2"]),
        ],
        "with_if",
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("s2", F, [2, 3]), helper.make_tensor_value_info("yi", F, [2, 3])],
        initializer=[cond],
    )


def _body_reading(name: str) -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Add", ["s", name], ["s2"]), helper.make_node("Neg", ["x"], ["y"])],
        "reads",
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("s2", F, [2, 3]), helper.make_tensor_value_info("y", F, [2, 3])],
    )


def _body_with_extra_input() -> onnx.GraphProto:
    body = accumulate_body()
    body.input.append(helper.make_tensor_value_info("unused", F, [2, 3]))
    return body


@pytest.mark.parametrize(
    ("rule", "model"),
    [
        ("domain", scan_model(accumulate_body(), domain="com.example")),
        ("domain", scan_model(accumulate_body(), opset=8)),
        ("state", scan_model(accumulate_body(), num_scan_inputs=2)),
        ("arity", scan_model(_body_with_extra_input())),
        ("static-extent", scan_model(accumulate_body(), x_shape=(4, 2, 3))),
        ("control-flow", scan_model(_body_with_if())),
        ("captures", scan_model(_body_reading("nowhere"))),
    ],
)
def test_an_ineligible_scan_is_left_alone_and_the_failed_rule_is_named(
    rule: str, model: onnx.ModelProto
) -> None:
    out, skipped, inlined = inline(model)
    assert inlined == []
    assert skipped["the_scan"].startswith(f"{rule}:")
    assert op_types(out) == op_types(model)


def test_a_value_produced_after_the_scan_is_not_a_resolvable_capture() -> None:
    model = scan_model(_body_reading("late"))
    model.graph.node.append(helper.make_node("Neg", ["s"], ["late"]))  # after the Scan
    _, skipped, _ = inline(model)
    assert skipped["the_scan"].startswith("captures:")


def test_a_declared_scan_extent_of_one_is_eligible() -> None:
    model = scan_model(accumulate_body(), x_shape=(1, 2, 3))
    out, _, inlined = inline(model)
    assert inlined == ["the_scan"]
    assert_same_outputs(model, out, feeds_for((1, 2, 3)))


def test_a_graph_without_eligible_scans_is_reported_unmodified() -> None:
    model = scan_model(accumulate_body(), x_shape=(4, 2, 3))
    done = inline_single_trip_scans(model)
    out, modified = done.model, done.modified
    assert modified is False
    assert isinstance(out, onnx.ModelProto) and op_types(out) == ["Scan"]


def test_the_ir_entry_point_rewrites_in_place_and_says_so() -> None:
    model = ir.serde.deserialize_model(scan_model(accumulate_body()))
    done = inline_single_trip_scans(model)
    out, modified = done.model, done.modified
    assert modified is True and out is model
    assert [n.op_type for n in model.graph] == ["Squeeze", "Mul", "Add", "Tanh", "Unsqueeze"]


def test_the_proto_entry_point_keeps_external_data_entries_it_does_not_know() -> None:
    model = scan_model(accumulate_body(), initializers=[helper.make_tensor("w", F, [2], [1.0, 2.0])])
    w = model.graph.initializer[0]
    w.ClearField("float_data")
    w.data_location = TensorProto.EXTERNAL
    entries = {
        "location": "weights.bin",
        "offset": "4096",
        "length": "8",
        "prepacked_0": "MatMul+1|8192;64;0",
    }
    for k, v in entries.items():
        w.external_data.add(key=k, value=v)
    done = inline_scans_in_proto(model)
    out, result = done.model, done
    assert result.modified
    kept = next(t for t in out.graph.initializer if t.name == "w")
    assert {e.key: e.value for e in kept.external_data} == entries
