"""onnxgen.graph.decode_fusions: the rewritten graphs compute every output bit for bit as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.graph.decode_fusions import fuse_for_decode
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import build_model
from onnxgen.testing.quant import quantize_int4

HIDDEN, HEAD, Q_HEADS, KV_HEADS = 64, 16, 4, 2
RNG = np.random.default_rng(0)


def _nbits(name: str, x: str, n: int, k: int = HIDDEN, accuracy: int = 4, zero_points: bool = False) -> tuple:
    q = quantize_int4(RNG.standard_normal((k, n)).astype(np.float32))
    inits = [numpy_helper.from_array(q.packed, f"{name}.w"), numpy_helper.from_array(q.scales, f"{name}.s")]
    inputs = [x, f"{name}.w", f"{name}.s"]
    if zero_points:
        zp = np.full((n, (q.blocks + 1) // 2), 0x88, np.uint8)
        inits.append(numpy_helper.from_array(zp, f"{name}.zp"))
        inputs.append(f"{name}.zp")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        [name],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=q.block_size,
        accuracy_level=accuracy,
        name=name,
    )
    return node, inits


def _model(nodes: list, inits: list, inputs: list, outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b, strict=True)
    )


def _mlp(zero_points: bool = False, accuracy_up: int = 4, gate_zero_points: bool = False) -> onnx.ModelProto:
    gate, g_inits = _nbits("gate", "x", 96, zero_points=gate_zero_points)
    up, u_inits = _nbits("up", "x", 96, accuracy=accuracy_up, zero_points=zero_points)
    other, o_inits = _nbits("other", "y", 32)  # a different input: nothing to merge with
    nodes = [gate, up, other, helper.make_node("Mul", ["gate", "up"], ["out"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, HIDDEN])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, HIDDEN])
    return _model(nodes, g_inits + u_inits + o_inits, [x, y], ["out", "up", "other"])


@pytest.mark.parametrize("tokens", [1, 7])
def test_sibling_matmuls_merge_into_one_with_the_same_outputs(tokens: int) -> None:
    model = _mlp()
    done = fuse_for_decode(model, None)
    fused, fusions = done.model, done.report
    assert fusions.merged_matmuls == 2 and fusions.merged_norms == 0
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("Split") == 1
    assert {i.name for i in fused.graph.initializer}.isdisjoint({"gate.w", "up.w", "gate.s", "up.s"})
    feeds = {k: RNG.standard_normal((1, tokens, HIDDEN)).astype(np.float32) for k in ("x", "y")}
    assert _same(_run(model, feeds), _run(fused, feeds))
    assert len(model.graph.node) == 4  # the input model is left as it was


@pytest.mark.parametrize("tokens", [1, 7])
def test_siblings_with_zero_points_merge_with_the_same_outputs(tokens: int) -> None:
    model = _mlp(zero_points=True, gate_zero_points=True)
    for node in model.graph.initializer:  # zero points that differ per row and block
        if node.name.endswith(".zp"):
            node.CopyFrom(
                numpy_helper.from_array(RNG.integers(0, 256, tuple(node.dims), dtype=np.uint8), node.name)
            )
    done = fuse_for_decode(model, None)
    assert done.report.merged_matmuls == 2
    fused = [n for n in done.model.graph.node if n.op_type == "MatMulNBits" and "onnxgen_merged" in n.name]
    assert len(fused) == 1 and len(fused[0].input) == 4
    feeds = {k: RNG.standard_normal((1, tokens, HIDDEN)).astype(np.float32) for k in ("x", "y")}
    assert _same(_run(model, feeds), _run(done.model, feeds))


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (_mlp(zero_points=True), "zero points on one only"),
        (_mlp(accuracy_up=0), "another accuracy level"),
    ],
)
def test_matmuls_that_differ_are_not_merged(model: onnx.ModelProto, why: str) -> None:
    done = fuse_for_decode(model, None)
    fused, fusions = done.model, done.report
    assert fusions.merged_matmuls == 0, why
    assert fused is model


def test_merged_weights_over_the_inline_limit_are_left_as_they_are() -> None:
    from onnxgen.graph.decode_fusions import Fusions, merge_sibling_matmuls

    model, fusions = _mlp(), Fusions()
    merge_sibling_matmuls(model, None, fusions, max_bytes=100)
    assert fusions.merged_matmuls == 0 and "inline limit" in fusions.skipped[0]


def _attention(epsilons: tuple[float, float] = (1e-6, 1e-6), value_to_gqa: bool = True) -> onnx.ModelProto:
    """A fused QKV projection, per-head query/key RMSNorms as onnxruntime-genai's builder writes them, and
    GroupQueryAttention (no rotary, empty past)."""
    qkv, inits = _nbits("qkv", "x", (Q_HEADS + 2 * KV_HEADS) * HEAD)
    q_w, k_w = (RNG.standard_normal(HEAD).astype(np.float32) for _ in range(2))
    sizes = [Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD]
    inits += [
        numpy_helper.from_array(np.array(sizes, np.int64), "sizes"),
        numpy_helper.from_array(np.array([0, -1, HEAD], np.int64), "heads"),
        numpy_helper.from_array(np.array([0, -1, sizes[0]], np.int64), "q_flat"),
        numpy_helper.from_array(np.array([0, -1, sizes[1]], np.int64), "k_flat"),
        numpy_helper.from_array(q_w, "q_norm.w"),
        numpy_helper.from_array(k_w, "k_norm.w"),
    ]
    nodes = [qkv, helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1)]
    for part, eps in zip("qk", epsilons, strict=True):
        nodes += [
            helper.make_node("Reshape", [part, "heads"], [f"{part}_h"]),
            helper.make_node(
                "SimplifiedLayerNormalization",
                [f"{part}_h", f"{part}_norm.w"],
                [f"{part}_n"],
                axis=-1,
                epsilon=eps,
                stash_type=1,
            ),
            helper.make_node("Reshape", [f"{part}_n", f"{part}_flat"], [f"{part}_normed"]),
        ]
    value = "v" if value_to_gqa else "v_copy"
    if not value_to_gqa:
        nodes.append(helper.make_node("Identity", ["v"], ["v_copy"]))
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            ["q_normed", "k_normed", value, "past_k", "past_v", "seqlens_k", "total_len"],
            ["attn", "present_k", "present_v"],
            domain="com.microsoft",
            num_heads=Q_HEADS,
            kv_num_heads=KV_HEADS,
        )
    )
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, HIDDEN]),
        helper.make_tensor_value_info("past_k", TensorProto.FLOAT, [1, KV_HEADS, None, HEAD]),
        helper.make_tensor_value_info("past_v", TensorProto.FLOAT, [1, KV_HEADS, None, HEAD]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
    ]
    return _model(nodes, inits, inputs, ["attn", "present_k", "present_v"])


def _attention_feeds(tokens: int) -> dict[str, np.ndarray]:
    empty = np.zeros((1, KV_HEADS, 0, HEAD), np.float32)
    return {
        "x": RNG.standard_normal((1, tokens, HIDDEN)).astype(np.float32) * 3,
        "past_k": empty,
        "past_v": empty,
        "seqlens_k": np.array([tokens - 1], np.int32),
        "total_len": np.array(tokens, np.int32),
    }


@pytest.mark.parametrize("tokens", [1, 5])
def test_query_and_key_norms_merge_into_one_with_the_same_outputs(tokens: int) -> None:
    model = _attention()
    done = fuse_for_decode(model, None)
    fused, fusions = done.model, done.report
    assert fusions.merged_norms == 1
    assert [n.op_type for n in fused.graph.node].count("SimplifiedLayerNormalization") == 1
    feeds = _attention_feeds(tokens)
    assert _same(_run(model, feeds), _run(fused, feeds))


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (_attention(epsilons=(1e-6, 1e-5)), "different epsilons"),
        (_attention(value_to_gqa=False), "the value does not go straight into GroupQueryAttention"),
    ],
)
def test_norms_that_differ_or_are_not_attention_inputs_are_not_merged(
    model: onnx.ModelProto, why: str
) -> None:
    done = fuse_for_decode(model, None)
    _, fusions = done.model, done.report
    assert fusions.merged_norms == 0, why


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_session_logits_are_bit_identical_with_and_without_the_fusions(tmp_path: Path, family: str) -> None:
    """Through the session (prefill, decode lane steps, external weights) on int4 fixtures."""
    package = ModelPackage.open(build_model(tmp_path, family, precision="int4"))
    sessions = [
        DecoderSession(session_graph(package.model_path, package.io, fuse=f, threads=2), threads=2)
        for f in (True, False)
    ]
    assert sessions[0].fusions.merged_matmuls > 0 and not sessions[1].fusions.rewritten
    runs = []
    for session in sessions:
        state = session.new_state(64)
        rows = [session.forward(state, np.array([[5, 9, 2, 7, 1, 3]]))]
        token = int(rows[0][0, -1].argmax())
        for _ in range(12):
            rows.append(session.step(state, token).copy())
            token = int(rows[-1].argmax())
        runs.append(rows)
    assert _same(runs[0], runs[1])


def test_inspect_and_load_report_what_the_session_merges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import onnxgen
    from onnxgen.cli import main

    model_dir = build_model(tmp_path, "genai-dense", precision="int4")
    assert main(["inspect", str(model_dir), "--json", "--threads", "2"]) == 0
    reported = json.loads(capsys.readouterr().out)["decode_fusions"]
    merged = onnxgen.load(model_dir, threads=2).session.fusions
    assert merged.merged_matmuls > 0 and reported == merged.summary()
    assert not onnxgen.load(model_dir, threads=1, fuse=False).session.fusions.rewritten
    monkeypatch.setenv("ONNXGEN_FUSE", "0")
    assert not onnxgen.load(model_dir, threads=1).session.fusions.rewritten


def _linear_qkv(p_key: int = 2, heads: int = 16, dim: int = 128) -> onnx.ModelProto:
    """A Gated DeltaNet layer's convolved ``q, k, v`` split three ways, with per-head L2 norms of ``q`` and
    ``k`` as onnxruntime-genai's builder writes them (the query then scaled)."""
    width = heads * dim
    ints = {
        "sizes": [width, width, width],
        "heads": [0, 0, heads, dim],
        "flat": [0, 0, width],
    }
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    inits.append(numpy_helper.from_array(np.array(0.0884, np.float32), "scale"))
    nodes = [helper.make_node("Split", ["x", "sizes"], ["q", "k", "v"], axis=-1)]
    for name, p in (("q", 2), ("k", p_key)):
        nodes += [
            helper.make_node("Reshape", [name, "heads"], [f"{name}4"]),
            helper.make_node("LpNormalization", [f"{name}4"], [f"{name}n"], axis=-1, p=p),
            helper.make_node("Reshape", [f"{name}n", "flat"], [f"{name}_out"]),
        ]
    nodes.append(helper.make_node("Mul", ["q_out", "scale"], ["q_scaled"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, 3 * width])
    return _model(nodes, inits, [x], ["q_scaled", "k_out", "v"])


@pytest.mark.parametrize("tokens", [1, 5])
def test_linear_attention_l2_norms_merge_with_the_same_outputs(tokens: int) -> None:
    model = _linear_qkv()
    done = fuse_for_decode(model, None)
    fused, fusions = done.model, done.report
    assert fusions.merged_l2_norms == 1 and fusions.merged_matmuls == 0
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("LpNormalization") == 1 and len(ops) == len(model.graph.node) - 2
    feeds = {"x": RNG.standard_normal((1, tokens, 3 * 16 * 128)).astype(np.float32)}
    assert _same(_run(model, feeds), _run(fused, feeds))
    # negative control: the merged norm over vectors of another length (a wrong head split) changes them
    wrong = onnx.ModelProto()
    wrong.CopyFrom(fused)
    for init in wrong.graph.initializer:
        if init.name.endswith(".heads"):
            init.CopyFrom(numpy_helper.from_array(np.array([0, 0, 16, 256], np.int64), init.name))
    assert not _same(_run(model, feeds), _run(wrong, feeds))


def test_l2_norms_that_differ_are_not_merged() -> None:
    done = fuse_for_decode(_linear_qkv(p_key=1), None)
    assert done.report.merged_l2_norms == 0 and not done.modified


def _merged_nodes(graph: onnx.ModelProto) -> list[str]:
    return [n.name for n in graph.graph.node if n.op_type == "MatMulNBits" and "onnxgen_merged" in n.name]


def _rows(session: DecoderSession, steps: int = 10) -> list[np.ndarray]:
    """Logits of a prefill (every position) and of greedy single-token steps after it."""
    state = session.new_state(32)
    rows = [session.forward(state, np.array([[5, 9, 2, 7, 1, 3]]))[0]]
    for _ in range(steps):
        rows.append(session.step(state, int(rows[-1][-1].argmax())).copy()[None])
    return rows


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_siblings_merge_only_for_sessions_of_two_threads_or_more(tmp_path: Path, family: str) -> None:
    """One thread: no merged MatMulNBits (the other fusions stay), a cache entry of its own; two: merged.
    Either way the logits are those of the graph without any fusion, bit for bit, on as many threads."""
    import dataclasses

    package = ModelPackage.open(build_model(tmp_path, family, precision="int4"))
    prepared = {t: session_graph(package.model_path, package.io, threads=t) for t in (1, 2, 4)}
    one, two = prepared[1], prepared[2]
    assert not one.settings.merge_matmuls and one.fusions.merged_matmuls == 0
    assert not _merged_nodes(one.load_graph()) and one.fusions.separate_matmuls == two.fusions.merged_matmuls
    assert two.settings.merge_matmuls and two.fusions.merged_matmuls > 0 and _merged_nodes(two.load_graph())
    assert one.graph_path != two.graph_path and prepared[4].graph_path == two.graph_path
    exported = sum(n.op_type == "MatMulNBits" for n in package.graph.graph.node)
    assert sum(n.op_type == "MatMulNBits" for n in one.load_graph().graph.node) == exported
    # the other fusions do not depend on the threads
    assert (one.fusions.merged_norms, one.fusions.merged_l2_norms) == (
        two.fusions.merged_norms,
        two.fusions.merged_l2_norms,
    )
    # a sibling graph (the inline decode plan's) takes the same rewrites as its session's graph
    sibling = onnx.load(str(package.model_path), load_external_data=False)
    assert not _merged_nodes(one.same_rewrites(sibling, package.root))
    assert _merged_nodes(two.same_rewrites(sibling, package.root))
    unfused = session_graph(package.model_path, package.io, fuse=False, threads=2)
    for threads, graph in ((1, one), (2, two)):
        got = _rows(DecoderSession(graph, threads=threads, verify=False))
        assert _same(got, _rows(DecoderSession(unfused, threads=threads, verify=False)))
    # negative control: a merged MLP's gate and up outputs swapped (same sizes) change the logits
    wrong = two.load_graph()
    sizes = {
        i.name: numpy_helper.to_array(i).tolist()
        for i in wrong.graph.initializer
        if i.name.endswith(".sizes")
    }
    split = next(
        n
        for n in wrong.graph.node
        if n.name.endswith("onnxgen_merged/split") and len(set(sizes[n.input[1]])) == 1
    )
    split.output[:] = list(reversed(split.output))
    onnx.save(wrong, str(tmp_path / "wrong.onnx"))
    miswired = dataclasses.replace(two, graph_path=tmp_path / "wrong.onnx")
    assert not _same(_rows(DecoderSession(miswired, threads=2, verify=False)), got)


def test_a_load_prepares_for_its_threads(tmp_path: Path) -> None:
    """The engine's load (onnxgen.prepare) and an MTP head pass their threads to the passes."""
    import onnxgen

    model_dir = build_model(tmp_path, "hybrid-genai", precision="int4")
    assert onnxgen.load(model_dir, threads=1).session.fusions.merged_matmuls == 0
    assert onnxgen.load(model_dir, threads=2).session.fusions.merged_matmuls > 0
