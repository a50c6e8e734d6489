"""onnxgen.graph.kept_rows: the last layer's tail on the kept rows gives every output bit as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.graph.hidden_state import expose_hidden_state
from onnxgen.graph.logits_to_keep import LOGITS_TO_KEEP, keep_last_logits
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import build_model
from onnxgen.testing.quant import quantize_int4

CASES = [
    ("genai-dense", "int4"),
    ("hybrid-genai", "int4"),
    ("hybrid-genai", "fp32"),
    ("standard-dense", "fp32"),
]


def _session(model: onnx.ModelProto, folder: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, tokens: int) -> dict[str, np.ndarray]:
    """A prompt of ``tokens`` ids after an empty cache (every past input zero-length or zero)."""
    ids = np.arange(3, 3 + tokens, dtype=np.int64)[None]
    feeds: dict[str, np.ndarray] = {}
    for port in session.get_inputs():
        if port.name == "input_ids":
            feeds[port.name] = ids
        elif port.name == "attention_mask":
            feeds[port.name] = np.ones_like(ids)
        elif port.name == "position_ids":
            positions = np.arange(tokens, dtype=np.int64)[None]
            feeds[port.name] = positions if len(port.shape) == 2 else np.stack([positions] * 3)
        elif port.name != LOGITS_TO_KEEP:
            shape = [d if isinstance(d, int) else (0 if "past" in str(d) else 1) for d in port.shape]
            feeds[port.name] = np.zeros(shape, np.float32)
    return feeds


def _tail_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.name.startswith("onnxgen_tail")]


@pytest.mark.parametrize("family,precision", CASES)
def test_the_tail_on_kept_rows_gives_every_output_bit_as_before(
    tmp_path: Path, family: str, precision: str
) -> None:
    d = build_model(tmp_path, family, precision=precision)
    graph = onnx.load(str(d / "model.onnx"), load_external_data=False)
    before = keep_last_logits(graph, "logits", tail_rows=False).model
    after = keep_last_logits(graph, "logits").model
    slices = [n for n in _tail_nodes(after) if n.op_type == "Slice"]
    if family == "standard-dense":
        # its RMSNorms are decomposed (Pow, ReduceMean, Sqrt, Div), which onnxruntime fuses: no slice in between
        assert not slices
    else:  # the residual and the attention output enter the tail
        assert len(slices) >= 2
        assert any(n.op_type == "GroupQueryAttention" for n in graph.graph.node)
    old, new = _session(before, d), _session(after, d)
    for tokens in (1, 2, 3, 7):
        feeds = _feeds(old, tokens)
        for keep in range(1, tokens + 1):
            feeds[LOGITS_TO_KEEP] = np.array([keep], dtype=np.int64)
            want, got = old.run(None, feeds), new.run(None, feeds)
            assert got[0].shape == want[0].shape == (1, keep, want[0].shape[-1])
            for name, a, b in zip([o.name for o in old.get_outputs()], want, got, strict=True):
                assert np.array_equal(a, b), f"{name} differs at {tokens} tokens keeping {keep}"


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_a_one_row_tail_would_round_otherwise(tmp_path: Path, family: str) -> None:
    """Negative control of the test above: the tail on the last row alone (no floor of 2 rows) runs the
    int4 projections on onnxruntime's one-row kernel, and the kept logits of a prompt change."""
    d = build_model(tmp_path, family, precision="int4")
    graph = onnx.load(str(d / "model.onnx"), load_external_data=False)
    before = keep_last_logits(graph, "logits", tail_rows=False).model
    one_row = keep_last_logits(graph, "logits").model
    for init in one_row.graph.initializer:
        if init.name == "onnxgen_tail_min_rows":
            init.CopyFrom(numpy_helper.from_array(np.array([1], np.int64), init.name))
    old, new = _session(before, d), _session(one_row, d)
    feeds = {**_feeds(old, 7), LOGITS_TO_KEEP: np.array([1], dtype=np.int64)}
    want, got = old.run(["logits"], feeds)[0], new.run(["logits"], feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)  # the same math ...
    assert not np.array_equal(got, want)  # ... rounded otherwise


def _projection(op: str, k: int, n: int, rng: np.random.Generator) -> onnx.ModelProto:
    """One projection of ``[1, rows, k]`` to ``n`` columns: int4 ``MatMulNBits`` or float ``MatMul``."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    if op == "MatMulNBits":
        q = quantize_int4(w)
        inits = [numpy_helper.from_array(q.packed, "w"), numpy_helper.from_array(q.scales, "s")]
        node = helper.make_node(
            "MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
            block_size=q.block_size, accuracy_level=4,
        )  # fmt: skip
    else:
        inits, node = [numpy_helper.from_array(w, "w")], helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


@pytest.mark.parametrize("op", ["MatMulNBits", "MatMul"])
@pytest.mark.parametrize("k", [1024, 3584])
def test_projection_rows_do_not_depend_on_the_row_count_from_two(op: str, k: int) -> None:
    """What the floor of 2 rows rests on, at real sizes of K: each row of an int4 ``MatMulNBits`` or a
    float ``MatMul`` over 2 or more rows comes out bit for bit as in a 200-row product."""
    rng = np.random.default_rng(1)
    model = _projection(op, k, 256, rng)
    for threads in (1, 2):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        x = rng.standard_normal((1, 200, k)).astype(np.float32)
        full = session.run(None, {"x": x})[0]
        for rows in (2, 3, 17):
            assert np.array_equal(session.run(None, {"x": x[:, -rows:]})[0], full[:, -rows:])


def test_an_exposed_hidden_state_keeps_the_tail_on_every_row(tmp_path: Path) -> None:
    """The final hidden state as a graph output (what an MTP head reads) holds every position: the tail
    that makes it stays whole."""
    d = build_model(tmp_path, "genai-dense", precision="int4")
    graph = onnx.load(str(d / "model.onnx"), load_external_data=False)
    exposed = expose_hidden_state(graph, "logits")
    assert exposed.output is not None
    kept = keep_last_logits(exposed.model, "logits").model
    assert not _tail_nodes(kept)
    outputs = _session(kept, d).run(
        [exposed.output], {**_feeds(_session(kept, d), 5), LOGITS_TO_KEEP: np.array([1], dtype=np.int64)}
    )
    assert outputs[0].shape[1] == 5


def test_sessions_with_and_without_the_tail_decode_alike(tmp_path: Path) -> None:
    """Through the session and the prepared-graph cache: a prefill, steps and a 3-row verify-like forward
    give the same logits bit for bit with the pass and without it (each prepared under its own key)."""
    d = build_model(tmp_path / "m", "hybrid-genai", precision="int4")
    package = ModelPackage.open(d)
    made = {
        on: DecoderSession(
            session_graph(package.model_path, package.io, cache_dir=tmp_path / "cache", tail_rows=on),
            threads=1,
            verify=False,
        )
        for on in (True, False)
    }
    assert made[True].prepared.graph_path != made[False].prepared.graph_path
    seen = {}
    for on, session in made.items():
        state = session.new_state(32)
        logits = [np.array(session.forward(state, np.array([[5, 9, 2, 11, 4, 8]]), 1))]
        token = int(logits[-1][0, -1].argmax())
        for _ in range(4):
            logits.append(np.array(session.step(state, token)))
            token = int(logits[-1].argmax())
        logits.append(np.array(session.forward(state, np.array([[token, 3, 7]]), 3)))
        seen[on] = logits
    for a, b in zip(seen[True], seen[False], strict=True):
        assert np.array_equal(a, b)
