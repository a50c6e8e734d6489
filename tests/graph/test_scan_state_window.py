from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgen.graph.scan_state_window import emit_scan_states
from onnxgen.graph.state_window import PerPosition
from onnxgen.model import ModelPackage
from onnxgen.testing import TinySpec, build_model

PROMPT = [5, 17, 200, 33, 44, 91]
DRAFT = [12, 8, 150, 23, 77]


class Runner:
    """Plain onnxruntime forwards of a tiny hybrid export (growing KV, zero states) over a rewritten graph."""

    def __init__(self, model_dir: Path, model: onnx.ModelProto) -> None:
        self.io = ModelPackage.open(model_dir).io
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_dir))
        self.sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.sess.get_outputs()]

    def empty(self) -> dict[str, np.ndarray]:
        pasts = {}
        for p in self.io.kv_pairs:
            for name in p.inputs:
                pasts[name] = np.zeros((1, p.kv_heads, 0, p.head_dim), np.float32)
        for s in self.io.state_pairs:
            pasts[s.input] = np.zeros([1, *s.shape[1:]], np.float32)
        return pasts

    def run(self, pasts: dict[str, np.ndarray], tokens: list[int]) -> dict[str, np.ndarray]:
        past_len = next(iter(pasts[n] for p in self.io.kv_pairs for n in p.inputs)).shape[2]
        t = len(tokens)
        pos = np.arange(past_len, past_len + t, dtype=np.int64)[None]
        feeds = {
            "input_ids": np.asarray([tokens], np.int64),
            "attention_mask": np.ones((1, past_len + t), np.int64),
            "position_ids": np.stack([pos] * 3) if self.io.position_ids_rank == 3 else pos,
        }
        return dict(zip(self.names, self.sess.run(None, feeds | pasts), strict=True))

    def pasts_after(self, outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pasts = {}
        for p in self.io.kv_pairs:
            pasts[p.past_key], pasts[p.past_value] = outs[p.present_key], outs[p.present_value]
        pasts.update({s.input: outs[s.output] for s in self.io.state_pairs})
        return pasts


def _pairs(model_dir: Path) -> list[tuple[str, str]]:
    return [(p.input, p.output) for p in ModelPackage.open(model_dir).io.state_pairs]


@pytest.fixture(scope="module")
def scan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("scan"), "hybrid-scan", TinySpec.hybrid())


def _rewritten(model_dir: Path) -> tuple[onnx.ModelProto, onnx.ModelProto, list[PerPosition]]:
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    done = emit_scan_states(model, _pairs(model_dir))
    out, result = done.model, done.report
    assert not result.skipped, result.skipped
    return model, out, result.per_position


def test_every_state_of_a_scan_export_gets_a_per_position_output(scan_dir: Path) -> None:
    model, out, per = _rewritten(scan_dir)
    pairs = _pairs(scan_dir)
    assert {p.state_output for p in per} == {present for _, present in pairs}
    assert {p.layout for p in per if "conv" in p.state_output} == {"window"}
    assert {p.layout for p in per if "recurrent" in p.state_output} == {"rows"}
    outputs = [o.name for o in out.graph.output]
    assert outputs[: len(model.graph.output)] == [o.name for o in model.graph.output]
    assert all(p.output in outputs for p in per)
    assert [i.name for i in out.graph.input] == [i.name for i in model.graph.input]
    assert len(model.graph.output) == 9, "the input model must not change"


def test_per_position_states_of_a_verify_equal_fresh_runs_over_each_prefix(scan_dir: Path) -> None:
    _, out, per = _rewritten(scan_dir)
    run = Runner(scan_dir, out)
    before = run.pasts_after(run.run(run.empty(), PROMPT))
    verify = run.run(before, DRAFT)
    seen = []
    for kept in range(1, len(DRAFT) + 1):
        fresh = run.run(before, DRAFT[:kept])
        for p in per:
            got = p.select(verify[p.output], len(DRAFT), kept)
            want = fresh[p.state_output]
            assert got is not None and got.shape == want.shape
            if kept == 1:
                # A one-token forward takes one-row (GEMV) kernels that round differently from the
                # multi-row verify: equal to float32 rounding only.
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=p.state_output)
            else:
                assert np.array_equal(got, want), f"{p.state_output} after {kept} tokens"
        seen.append(per[1].select(verify[per[1].output], len(DRAFT), kept).copy())
    assert not np.array_equal(seen[0], seen[-1]), "the states after different prefixes must differ"


def test_the_rewritten_graph_answers_ordinary_forwards_bit_identically(scan_dir: Path) -> None:
    model, out, _ = _rewritten(scan_dir)
    plain, rewritten = Runner(scan_dir, model), Runner(scan_dir, out)
    for tokens in (PROMPT, PROMPT[:1]):
        a, b = plain.run(plain.empty(), tokens), rewritten.run(rewritten.empty(), tokens)
        for name, value in a.items():
            assert np.array_equal(value, b[name]), name


def test_fused_state_ops_are_left_alone_with_the_reason(tmp_path: Path) -> None:
    d = build_model(tmp_path, "hybrid-genai", TinySpec.hybrid())
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    done = emit_scan_states(model, _pairs(d))
    out, result = done.model, done.report
    assert out is model and not result.per_position
    assert len(result.skipped) == 6
    assert "CausalConvWithState" in result.skipped["present.0.conv"]
    assert "LinearAttention" in result.skipped["present.0.recurrent"]


def _conv_graph(start: int, axis: int) -> onnx.ModelProto:
    past = helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 4, 3])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, "t"])
    present = helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, 4, 3])
    inits = [
        helper.make_tensor("starts", TensorProto.INT64, [1], [start]),
        helper.make_tensor("ends", TensorProto.INT64, [1], [2**63 - 1]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [axis]),
    ]
    nodes = [
        helper.make_node("Concat", ["past", "x"], ["joined"], axis=2),
        helper.make_node("Slice", ["joined", "starts", "ends", "axes"], ["present"]),
    ]
    graph = helper.make_graph(nodes, "conv", [past, x], [present], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_a_conv_window_written_with_a_negative_axis_is_recognised_and_selects_each_prefix() -> None:
    done = emit_scan_states(_conv_graph(-3, -1), [("past", "present")])
    out, result = done.model, done.report
    (p,) = result.per_position
    assert (p.layout, p.axis) == ("window", 2)
    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    past = np.arange(12, dtype=np.float32).reshape(1, 4, 3)
    x = 100 + np.arange(20, dtype=np.float32).reshape(1, 4, 5)
    window = dict(
        zip([o.name for o in sess.get_outputs()], sess.run(None, {"past": past, "x": x}), strict=True)
    )
    for kept in range(1, 6):
        want = np.concatenate([past, x[:, :, :kept]], axis=2)[:, :, -3:]
        assert np.array_equal(p.select(window[p.output], 5, kept), want)


def test_a_slice_that_is_not_the_trailing_window_is_left_alone_with_the_reason() -> None:
    graph = _conv_graph(1, 2)
    done = emit_scan_states(graph, [("past", "present")])
    out, result = done.model, done.report
    assert out is graph and not result.per_position
    assert "negative offset" in result.skipped["present"]
