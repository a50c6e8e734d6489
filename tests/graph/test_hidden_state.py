"""The hidden-state pass: the final norm's output becomes a graph output; the logits keep their bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgen.graph.hidden_state import HIDDEN_STATES, expose_hidden_state
from onnxgen.graph.logits_to_keep import keep_last_logits
from onnxgen.testing import TinySpec, build_model, make_weights

IDS = np.array([[3, 17, 42, 99, 7, 11]], dtype=np.int64)
CASES = [
    ("genai-dense", "fp32"),
    ("genai-dense", "int4"),
    ("standard-dense", "fp32"),
    ("hybrid-genai", "int4"),
    ("hybrid-mobius", "fp32"),
    ("hybrid-scan", "fp32"),
]


def _session(model: onnx.ModelProto, folder: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _prefill_feeds(sess: ort.InferenceSession) -> dict[str, np.ndarray]:
    """A prefill of IDS from empty caches and zero recurrent states."""
    t = IDS.shape[1]
    feeds: dict[str, np.ndarray] = {"input_ids": IDS, "attention_mask": np.ones_like(IDS)}
    for port in sess.get_inputs():
        if port.name == "position_ids":
            pos = np.arange(t, dtype=np.int64)[None]
            feeds[port.name] = np.stack([pos] * 3) if len(port.shape) == 3 else pos
        elif port.name.startswith("past"):
            is_kv = port.name.endswith((".key", ".value"))
            shape = [1 if i == 0 else 0 if (is_kv and i == 2) else d for i, d in enumerate(port.shape)]
            feeds[port.name] = np.zeros(shape, dtype=np.float32)
    return feeds


@pytest.mark.parametrize("family,precision", CASES)
def test_the_final_hidden_state_is_output_and_the_logits_keep_their_bits(
    tmp_path: Path, family: str, precision: str
) -> None:
    spec = TinySpec.hybrid() if family.startswith("hybrid") else TinySpec()
    d = build_model(tmp_path, family, spec, precision=precision)
    plain = onnx.load(str(d / "model.onnx"), load_external_data=False)
    result = expose_hidden_state(plain, "logits")
    assert result.modified and result.output == HIDDEN_STATES, result.report
    assert not any(o.name == HIDDEN_STATES for o in plain.graph.output), "the input model must not change"

    before, after = _session(plain, d), _session(result.model, d)
    feeds = _prefill_feeds(before)
    outputs = [o.name for o in before.get_outputs()]
    want = before.run(outputs, feeds)
    got = after.run([*outputs, HIDDEN_STATES], feeds)
    for name, a, b in zip(outputs, want, got, strict=False):
        assert np.array_equal(a, b), f"{name} changed"
    hidden = got[-1]
    assert hidden.shape == (1, IDS.shape[1], spec.hidden)
    if precision == "fp32":  # the lm_head's input: hidden @ lm_head gives the logits
        w = make_weights(spec)["lm_head"]
        np.testing.assert_allclose(hidden @ w, got[0], rtol=1e-4, atol=1e-4)


def test_an_export_that_outputs_the_hidden_state_is_left_as_it_is(tmp_path: Path) -> None:
    d = build_model(tmp_path, "genai-dense")
    exposed = expose_hidden_state(onnx.load(str(d / "model.onnx"), load_external_data=False), "logits")
    again = expose_hidden_state(exposed.model, "logits")
    assert not again.modified and again.model is exposed.model
    assert again.output == HIDDEN_STATES


def test_the_pass_refuses_a_graph_whose_lm_head_reads_the_kept_rows(tmp_path: Path) -> None:
    d = build_model(tmp_path, "genai-dense")
    done = keep_last_logits(onnx.load(str(d / "model.onnx"), load_external_data=False), "logits")
    kept, modified, _ = done.model, done.modified, done.report
    assert modified
    result = expose_hidden_state(kept, "logits")
    assert not result.modified and result.output is None
    assert "logits-to-keep" in result.report


def test_logits_not_made_by_a_matmul_give_no_hidden_state() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])],
    )
    result = expose_hidden_state(helper.make_model(graph), "logits")
    assert not result.modified and result.output is None
    assert "Relu" in result.report
