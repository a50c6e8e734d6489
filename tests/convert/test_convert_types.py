"""Every GGUF tensor type the converter maps: the graph computes with exactly the GGUF's weights.

For each type a tiny llama GGUF (tied embeddings, so the embedding is that type too) is written with
``gguf``'s writer and converted. Three things are checked on the converted graph, each by running it:

- a projection's effective weights (the ``gate_proj`` subgraph fed the identity) equal
  ``gguf.quants.dequantize``'s values bit for bit (fed the identity, the kernel's ``scale * q`` and the
  offsets added beside it round as GGUF's ``scale * q + offset`` does; an 8-bit type's high and low
  halves are exact products whose sum rounds once);
- embedding rows equal the dequantized rows bit for bit;
- logits match a float64 numpy forward pass of the dequantized weights (llama.cpp's conventions) to
  5e-5 of their range, for a prefill and for one decode step on the returned KV cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as T
from gguf_fixtures import Spec, TinyGGUF, reference_logits, write_gguf
from onnx import TensorProto, helper

from onnxgen.convert import convert_gguf

SYMMETRIC = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q3_K, T.Q6_K]
WITH_OFFSET = [T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K]
FLOATS = [T.F32, T.F16, T.BF16]
PROMPT = [258, 40, 71, 72, 259, 80, 3]
LOGIT_TOL = 5e-5  # of the logits' range: float32 kernels against a float64 reference (seen: up to 1.4e-5)


def convert(tmp_path: Path, spec: Spec, level: int = 1) -> tuple[TinyGGUF, Path]:
    g = write_gguf(tmp_path / "tiny.gguf", spec)
    return g, convert_gguf(g.path, tmp_path / "model", accuracy_level=level)


def subgraph(model_dir: Path, inputs: list[str], outputs: list[str]) -> ort.InferenceSession:
    """A session computing ``outputs`` from ``inputs`` with the converted graph's own nodes."""
    model = onnx.load(model_dir / "model.onnx")
    producer = {o: n for n in model.graph.node for o in n.output}
    keep: set[int] = set()
    todo = list(outputs)
    while todo:
        name = todo.pop()
        node = producer.get(name)
        if name in inputs or node is None or id(node) in keep:
            continue
        keep.add(id(node))
        todo.extend(node.input)
    nodes = [n for n in model.graph.node if id(n) in keep]
    used = {i for n in nodes for i in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]

    def info(name: str) -> onnx.ValueInfoProto:
        kind = TensorProto.INT64 if name == "input_ids" else TensorProto.FLOAT
        return helper.make_tensor_value_info(name, kind, None)

    graph = helper.make_graph(nodes, "sub", [info(i) for i in inputs], [info(o) for o in outputs], inits)
    sub = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])


def node_named(model_dir: Path, name: str) -> onnx.NodeProto:
    graph = onnx.load(model_dir / "model.onnx", load_external_data=False).graph
    return next(n for n in graph.node if n.name == name)


def gate_weights(model_dir: Path, hidden: int) -> np.ndarray:
    """``gate_proj``'s weights as layer 0's graph applies them: ``[N, K]``."""
    x = "/model/layers.0/post_attention_layernorm/SkipLayerNorm/output_0"
    y = node_named(model_dir, "/model/layers.0/mlp/act_fn/Sigmoid").input[0]
    sess = subgraph(model_dir, [x], [y])
    return sess.run(None, {x: np.eye(hidden, dtype=np.float32)[None]})[0][0].T


def embedding_rows(model_dir: Path, ids: list[int]) -> np.ndarray:
    rows = node_named(model_dir, "/model/layers.0/input_layernorm/LayerNorm").input[0]
    sess = subgraph(model_dir, ["input_ids"], [rows])
    return sess.run(None, {"input_ids": np.array([ids], np.int64)})[0][0]


def run_logits(model_dir: Path, spec: Spec, ids: list[int], split: int) -> np.ndarray:
    """Logits of ``ids``: a prefill of ``ids[:split]``, then the rest as one step on its KV cache."""
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    past = {
        f"past_key_values.{i}.{kind}": np.zeros((1, spec.kv_heads, 0, spec.head_dim), np.float32)
        for i in range(spec.layers)
        for kind in ("key", "value")
    }
    names = [o.name for o in sess.get_outputs()]
    out = []
    for chunk, total in ((ids[:split], split), (ids[split:], len(ids))):
        feeds = {
            "input_ids": np.array([chunk], np.int64),
            "attention_mask": np.ones((1, total), np.int64),
            **past,
        }
        result = dict(zip(names, sess.run(None, feeds), strict=True))
        out.append(result["logits"][0])
        past = {k: result[k.replace("past_key_values", "present")] for k in past}
    return np.concatenate(out)


def assert_logits(g: TinyGGUF, model_dir: Path) -> float:
    """The converted logits match the reference; returns the error relative to the logits' range."""
    ref = reference_logits(g, PROMPT)
    got = run_logits(model_dir, g.spec, PROMPT, split=5)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert err < LOGIT_TOL, err
    return err


@pytest.mark.parametrize("qtype", SYMMETRIC + WITH_OFFSET + FLOATS, ids=lambda t: t.name)
def test_each_type_computes_with_the_gguf_weights(tmp_path: Path, qtype: T) -> None:
    g, model_dir = convert(tmp_path, Spec(qtype=qtype))
    want = g.weights["blk.0.ffn_gate.weight"]
    got = gate_weights(model_dir, g.spec.hidden)
    np.testing.assert_array_equal(got, want)
    ids = list(range(0, 262, 7))
    np.testing.assert_array_equal(embedding_rows(model_dir, ids), g.weights["token_embd.weight"][ids])
    assert_logits(g, model_dir)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_quantized_types_become_4bit_matmulnbits_with_integer_zero_points(tmp_path: Path, qtype: T) -> None:
    """The form onnxruntime's CPU kernels run fast: 4 bits, no float zero points, no float weights."""
    _, model_dir = convert(tmp_path, Spec(qtype=qtype))
    model = onnx.load(model_dir / "model.onnx")
    graph, inits = model.graph, {t.name: t for t in model.graph.initializer}
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 2 * 5 + 1  # per layer qkv, o, gate, up, down; the lm_head
    assert ops.count("GatherBlockQuantized") == 1
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "bits")) == 4
            zero_points = node.input[3] if len(node.input) > 3 else ""
            assert not zero_points or inits[zero_points].data_type == TensorProto.UINT8
        if node.op_type == "MatMul":  # only the offsets' share: [blocks, N], a 32nd of the weights
            assert "/Offsets/" in node.name
    lm_head = next(n for n in graph.node if n.name == "/lm_head/MatMul_Q4")
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    reshape = next(n for n in graph.node if n.output[0] == gather.input[0])
    assert reshape.input[0] == lm_head.input[1] and gather.input[2] == lm_head.input[2]  # tied: shared


def test_a_wrong_rope_convention_shows_in_the_logits(tmp_path: Path) -> None:
    """Negative control: the logit check catches llama's RoPE applied the qwen way."""
    g, model_dir = convert(tmp_path, Spec(qtype=T.Q8_0))
    wrong = TinyGGUF(g.path, Spec(arch="qwen2", qtype=T.Q8_0), g.weights, g.raw)
    ref = reference_logits(wrong, PROMPT)
    got = run_logits(model_dir, g.spec, PROMPT, split=5)
    assert np.abs(got - ref).max() / np.abs(ref).max() > 100 * LOGIT_TOL


@pytest.mark.parametrize(
    "spec",
    [
        Spec(arch="qwen2", qtype=T.Q8_0, tied=False),
        Spec(arch="qwen3", qtype=T.Q4_K),
        Spec(arch="qwen3", qtype=T.Q4_0, v_type=T.Q8_0, tied=False),
        Spec(arch="llama", qtype=T.Q4_K, v_type=T.Q6_K),
        Spec(arch="llama", qtype=T.Q4_1, tied=False, heads=8, kv_heads=8, theta=100000.0),
        Spec(arch="llama", qtype=T.Q8_0, rope_freqs=True, theta=500000.0),
        Spec(arch="qwen3", qtype=T.Q8_0, heads=4, kv_heads=2, head_size=128),
    ],
    ids=[
        "qwen2-biases-untied",
        "qwen3-qk-norms",
        "qwen3-split-qkv",
        "llama-mixed-v",
        "llama-mha-untied",
        "llama-rope-freqs",
        "qwen3-wide-heads",
    ],
)
def test_architectures_match_the_reference(tmp_path: Path, spec: Spec) -> None:
    g, model_dir = convert(tmp_path, spec)
    assert_logits(g, model_dir)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_int8_activations_keep_8bit_weights_and_stay_close(tmp_path: Path, qtype: T) -> None:
    """Accuracy level 4 (int8 activations) approximates the same weights; 8-bit types stay 8-bit there
    (onnxruntime's 8-bit kernels are fast with int8 activations only) and embed rows exactly."""
    g, model_dir = convert(tmp_path, Spec(qtype=qtype), level=4)
    graph = onnx.load(model_dir / "model.onnx", load_external_data=False).graph
    bits = {
        helper.get_attribute_value(a)
        for n in graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "bits"
    }
    assert bits == ({8} if qtype != T.Q4_1 else {4}) and "Concat" not in {n.op_type for n in graph.node}
    ids = list(range(0, 262, 7))
    np.testing.assert_array_equal(embedding_rows(model_dir, ids), g.weights["token_embd.weight"][ids])
    got = run_logits(model_dir, g.spec, PROMPT, split=5)
    ref = reference_logits(g, PROMPT)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 0.15  # seen: up to 0.06 on these random weights


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_weights_on_request_become_int4_blocks_of_the_same_weights(tmp_path: Path, qtype: T) -> None:
    from onnxgen.convert.weights import INT4_BLOCK

    g = write_gguf(tmp_path / "tiny.gguf", Spec(qtype=qtype))
    kept = convert_gguf(g.path, tmp_path / "kept")
    int4 = convert_gguf(g.path, tmp_path / "int4", float_weights="int4")
    want = g.weights["blk.0.ffn_gate.weight"]
    got = gate_weights(int4, g.spec.hidden)
    np.testing.assert_array_equal(gate_weights(kept, g.spec.hidden), want)  # the control: kept as they are
    assert not np.array_equal(got, want)  # quantized ...
    blocks = want.reshape(want.shape[0], -1, INT4_BLOCK)
    step = np.abs(blocks).max(axis=-1, keepdims=True) / 8  # ... round to nearest, 16 levels a block
    err = np.abs(got.reshape(blocks.shape) - blocks)
    assert (err <= step + 1e-6).all()  # (a step at most: +8 steps clips to +7)
    assert err.mean() < 0.3 * step.mean()  # a quarter of a step on average for round to nearest
    ops = {n.op_type for n in onnx.load(str(int4 / "model.onnx"), load_external_data=False).graph.node}
    assert "MatMul" not in ops and "MatMulNBits" in ops
    assert (int4 / "model.onnx.data").stat().st_size < 0.5 * (kept / "model.onnx.data").stat().st_size
    with pytest.raises(Exception, match="float_weights must be"):
        convert_gguf(g.path, tmp_path / "bad", float_weights="int8")
