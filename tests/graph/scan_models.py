"""Small hand-built Scan models for the inline-pass tests, and a runner that compares two models on onnxruntime."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

F = TensorProto.FLOAT


def accumulate_body(name: str = "body", prefix: str = "") -> onnx.GraphProto:
    """State s [2, 3] and one scan slice x [2, 3]: s' = s * x + s, y = tanh(s')."""
    p = prefix
    return helper.make_graph(
        [
            helper.make_node("Mul", [f"{p}s", f"{p}x"], [f"{p}sx"], name=f"{p}mul"),
            helper.make_node("Add", [f"{p}sx", f"{p}s"], [f"{p}s_out"], name=f"{p}add"),
            helper.make_node("Tanh", [f"{p}s_out"], [f"{p}y"], name=f"{p}tanh"),
        ],
        name,
        [
            helper.make_tensor_value_info(f"{p}s", F, [2, 3]),
            helper.make_tensor_value_info(f"{p}x", F, [2, 3]),
        ],
        [
            helper.make_tensor_value_info(f"{p}s_out", F, [2, 3]),
            helper.make_tensor_value_info(f"{p}y", F, [2, 3]),
        ],
    )


def scan_model(
    body: onnx.GraphProto,
    *,
    x_shape: Sequence[int | str] = ("T", 2, 3),
    in_axis: int | None = None,
    out_axis: int | None = None,
    directions: bool = False,
    opset: int = 21,
    num_scan_inputs: int = 1,
    domain: str = "",
    extra_nodes: Sequence[onnx.NodeProto] = (),
    initializers: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    """``s_out, y = Scan(s, x)`` with graph inputs s [2, 3] and x (``x_shape``), outputs s_out and y."""
    attrs: dict[str, object] = {"body": body, "num_scan_inputs": num_scan_inputs}
    if in_axis is not None:
        attrs["scan_input_axes"] = [in_axis]
    if out_axis is not None:
        attrs["scan_output_axes"] = [out_axis]
    if directions:
        attrs["scan_input_directions"] = [1]
        attrs["scan_output_directions"] = [1]
    scan = helper.make_node("Scan", ["s", "x"], ["s_final", "ys"], name="the_scan", domain=domain, **attrs)
    graph = helper.make_graph(
        [*extra_nodes, scan],
        "main",
        [helper.make_tensor_value_info("s", F, [2, 3]), helper.make_tensor_value_info("x", F, list(x_shape))],
        [helper.make_tensor_value_info("s_final", F, [2, 3]), helper.make_tensor_value_info("ys", F, None)],
        initializer=list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds), strict=True))


def feeds_for(x_shape: Sequence[int], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "s": rng.standard_normal((2, 3)).astype(np.float32),
        "x": rng.standard_normal(tuple(x_shape)).astype(np.float32),
    }


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]
