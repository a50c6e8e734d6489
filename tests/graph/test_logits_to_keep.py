from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgen.graph.logits_to_keep import LOGITS_TO_KEEP, keep_last_logits
from onnxgen.testing import build_model


def _session(model: onnx.ModelProto, folder: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("family,precision", [("standard-dense", "fp32"), ("genai-dense", "int4")])
def test_kept_logits_equal_the_last_rows_of_the_full_logits(
    tmp_path: Path, family: str, precision: str
) -> None:
    d = build_model(tmp_path, family, precision=precision)
    full = onnx.load(str(d / "model.onnx"), load_external_data=False)
    done = keep_last_logits(full, "logits")
    kept, modified, reason = done.model, done.modified, done.report
    assert modified, reason
    assert any(i.name == LOGITS_TO_KEEP for i in kept.graph.input)
    assert not any(i.name == LOGITS_TO_KEEP for i in full.graph.input), "the input model must not change"

    ids = np.array([[3, 17, 42, 99, 7, 11]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    names = {i.name for i in full.graph.input}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(6, dtype=np.int64)[None]
    for i in full.graph.input:
        if i.name.startswith("past_key_values"):
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = np.zeros((1, dims[1], 0, dims[3]), dtype=np.float32)
    want = _session(full, d).run(["logits"], feeds)[0]
    for n in (1, 3, 6):
        got = _session(kept, d).run(["logits"], {**feeds, LOGITS_TO_KEEP: np.array([n], dtype=np.int64)})[0]
        assert got.shape == (1, n, want.shape[-1])
        np.testing.assert_allclose(got, want[:, -n:], rtol=1e-5, atol=1e-5)


def test_logits_not_made_by_a_matmul_are_left_alone() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])],
    )
    model = helper.make_model(graph)
    done = keep_last_logits(model, "logits")
    out, modified, reason = done.model, done.modified, done.report
    assert not modified and out is model
    assert "Relu" in reason


def test_scaled_logits_are_traced_back_to_the_lm_head() -> None:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 8], np.ones(32, dtype=np.float32).tolist())
    s = helper.make_tensor("s", TensorProto.FLOAT, [], [0.5])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w"], ["raw"]), helper.make_node("Mul", ["raw", "s"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "s", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])],
        initializer=[w, s],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    done = keep_last_logits(model, "logits")
    out, modified, _ = done.model, done.modified, done.report
    assert modified
    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    h = np.arange(24, dtype=np.float32).reshape(1, 6, 4)
    got = sess.run(None, {"h": h, LOGITS_TO_KEEP: np.array([2], dtype=np.int64)})[0]
    np.testing.assert_allclose(got, (h[:, -2:] @ np.ones((4, 8), np.float32)) * 0.5)
