"""mask_feeds_lengths_only: which graphs may keep one capacity-long attention mask bound while decoding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.graph.mask_lengths import mask_feeds_lengths_only
from onnxgen.testing import FAMILIES, build_model

LENGTHS_ONLY = {"genai-dense", "hybrid-genai"}  # GroupQueryAttention fed ReduceSum(mask) and Shape(mask)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, onnx.ModelProto]:
    root = tmp_path_factory.mktemp("mask-lengths")
    return {
        f: onnx.load(str(build_model(root / f, f) / "model.onnx"), load_external_data=False) for f in FAMILIES
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_only_masks_that_give_attention_its_lengths_are_accepted(
    graphs: dict[str, onnx.ModelProto], family: str
) -> None:
    # the other families build an additive causal bias from the mask (its length sizes a Range)
    assert mask_feeds_lengths_only(graphs[family], "attention_mask") is (family in LENGTHS_ONLY)


def _with(model: onnx.ModelProto, *nodes: onnx.NodeProto, output: str | None = None) -> onnx.ModelProto:
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    changed.graph.node.extend(nodes)
    if output is not None:
        changed.graph.output.append(helper.make_tensor_value_info(output, TensorProto.INT64, None))
    return changed


def _producer_of(model: onnx.ModelProto, op: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op and "attention_mask" in n.input)


def test_the_builder_pattern_stops_being_accepted_when_the_mask_is_used_for_anything_else(
    graphs: dict[str, onnx.ModelProto],
) -> None:
    base = graphs["genai-dense"]
    assert mask_feeds_lengths_only(base, "attention_mask")
    # the mask itself read by another op, or returned
    cast = helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT)
    assert not mask_feeds_lengths_only(_with(base, cast, output="mask_f"), "attention_mask")
    assert not mask_feeds_lengths_only(_with(base, output="attention_mask"), "attention_mask")
    # its length sizing something (a Range of positions) rather than only GroupQueryAttention's input
    shape = _producer_of(base, "Shape").output[0]
    length = helper.make_node("Gather", [shape, "one_idx"], ["len_s"], axis=0)
    ranged = helper.make_node("Range", ["zero_s", "len_s", "one_s"], ["positions"])
    consts = [
        helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(v, dtype=np.int64), n))
        for n, v in (("one_idx", 1), ("zero_s", 0), ("one_s", 1))
    ]
    assert not mask_feeds_lengths_only(
        _with(base, *consts, length, ranged, output="positions"), "attention_mask"
    )
    # a length that becomes a graph output
    assert not mask_feeds_lengths_only(_with(base, output=shape), "attention_mask")


def test_a_sum_over_the_batch_axis_is_not_a_length(graphs: dict[str, onnx.ModelProto]) -> None:
    changed = onnx.ModelProto()
    changed.CopyFrom(graphs["genai-dense"])
    reduce = _producer_of(changed, "ReduceSum")
    axes = helper.make_node(
        "Constant",
        [],
        ["axes_batch"],
        value=numpy_helper.from_array(np.array([0], dtype=np.int64), "axes_batch"),
    )
    changed.graph.node.insert(0, axes)
    reduce.input[1] = "axes_batch"
    assert not mask_feeds_lengths_only(changed, "attention_mask")


def test_a_graph_without_that_input_is_refused(graphs: dict[str, onnx.ModelProto]) -> None:
    assert not mask_feeds_lengths_only(graphs["genai-dense"], "no_such_mask")
