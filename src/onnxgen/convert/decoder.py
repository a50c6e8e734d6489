"""A GGUF decoder (llama, qwen2, qwen3) as one ONNX model in onnxruntime-genai's builder layout.

Per layer, as the builder writes it: ``SkipSimplifiedLayerNormalization`` (the first layer's is a plain
``SimplifiedLayerNormalization``), the query/key/value projection (one ``MatMulNBits`` when the three
share a block type; qwen2's biases added after it; qwen3's per-head RMSNorms on query and key), then
``GroupQueryAttention`` with fused RoPE, the output projection, the next norm, and the SwiGLU MLP.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from onnxgen.convert.graph import MS, OPSET, WeightFile, Writer, graph_io, mask_lengths, rope_tables
from onnxgen.convert.reader import PERMUTED_QK, GGUFFile, Hparams
from onnxgen.convert.weights import Matrix, matrix, same_kind, stack, take_rows, unpermute_rows


def _qkv_matrices(f: GGUFFile, hp: Hparams, i: int) -> list[Matrix]:
    """Layer ``i``'s query, key and value weights, query and key rows in the checkpoint's order."""
    q, k, v = (matrix(f, f"blk.{i}.attn_{p}.weight") for p in "qkv")
    if hp.arch in PERMUTED_QK:
        q = take_rows(q, unpermute_rows(hp.heads, hp.heads * hp.head_dim))
        k = take_rows(k, unpermute_rows(hp.kv_heads, hp.kv_heads * hp.head_dim))
    return [q, k, v]


def _projections(w: Writer, f: GGUFFile, i: int, x: str, parts: list[Matrix]) -> list[str]:
    """``[qkv]`` (one projection when the three share a block type) or ``[q, k, v]``, biases added."""
    name, prefix = f"/model/layers.{i}/attn", f"model.layers.{i}.attn"
    biases = [f"blk.{i}.attn_{p}.bias" for p in "qkv"]
    has_bias = all(b in f.tensors for b in biases)
    if same_kind(parts):
        groups = [("qkv", stack(parts), biases)]
    else:
        groups = [(p, m, [b]) for p, m, b in zip("qkv", parts, biases, strict=True)]
    outs = []
    for p, m, bias_names in groups:
        y = w.linear(x, m, f"{prefix}.{p}_proj", f"{name}/{p}_proj")
        if has_bias:
            bias = w.init(f"{prefix}.{p}_proj.bias", np.concatenate([f.float_tensor(b) for b in bias_names]))
            y = w.one("Add", [y, bias], f"{name}/{p}_proj/Add")
        outs.append(y)
    return outs


def _qkv(w: Writer, f: GGUFFile, hp: Hparams, i: int, x: str) -> tuple[str, str, str]:
    """Query, key and value of layer ``i`` (``""`` for key and value when packed with the query)."""
    name = f"/model/layers.{i}/attn"
    outs = _projections(w, f, i, x, _qkv_matrices(f, hp, i))
    qn, kn = f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"
    if qn not in f.tensors or kn not in f.tensors:
        return (outs[0], "", "") if len(outs) == 1 else (outs[0], outs[1], outs[2])
    if len(outs) == 1:
        sizes = w.ints([hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim, hp.kv_heads * hp.head_dim])
        outs = w.node("Split", [outs[0], sizes], f"{name}/qkv_proj/Split", n_out=3, axis=-1)
    norm = f"model.layers.{i}.attn.%s_norm.weight"
    q = _head_norm(w, f, hp, outs[0], qn, f"{name}/q_norm", norm % "q", hp.heads)
    k = _head_norm(w, f, hp, outs[1], kn, f"{name}/k_norm", norm % "k", hp.kv_heads)
    return q, k, outs[2]


def _head_norm(
    w: Writer, f: GGUFFile, hp: Hparams, x: str, tensor: str, name: str, init: str, heads: int
) -> str:
    """RMSNorm over each head of ``x`` ``[batch, seq, heads * head_dim]`` (qwen3's query/key norms)."""
    per_head = w.one("Reshape", [x, w.ints([0, -1, hp.head_dim])], f"{name}/Reshape")
    normed = w.one(
        "SimplifiedLayerNormalization",
        [per_head, w.init(init, f.float_tensor(tensor))],
        f"{name}/SimplifiedLayerNormalization",
        axis=-1,
        epsilon=hp.eps,
        stash_type=1,
    )
    return w.one("Reshape", [normed, w.ints([0, -1, heads * hp.head_dim])], f"{name}/Reshape_1")


def _attention(w: Writer, f: GGUFFile, hp: Hparams, i: int, x: str, lengths: tuple[str, str]) -> str:
    name = f"/model/layers.{i}/attn"
    q, k, v = _qkv(w, f, hp, i, x)
    inputs = [
        q,
        k,
        v,
        f"past_key_values.{i}.key",
        f"past_key_values.{i}.value",
        *lengths,
        "cos_cache",
        "sin_cache",
    ]
    out = f"{name}/GroupQueryAttention/output_0"
    w.nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            inputs,
            [out, f"present.{i}.key", f"present.{i}.value"],
            name=f"{name}/GroupQueryAttention",
            domain=MS,
            num_heads=hp.heads,
            kv_num_heads=hp.kv_heads,
            scale=1.0 / math.sqrt(hp.head_dim),
            local_window_size=-1,
            softcap=0.0,
            do_rotary=1,
            rotary_interleaved=0,
        )
    )
    o = matrix(f, f"blk.{i}.attn_output.weight")
    return w.linear(out, o, f"model.layers.{i}.attn.o_proj", f"{name}/o_proj")


def _mlp(w: Writer, f: GGUFFile, i: int, x: str) -> str:
    name, prefix = f"/model/layers.{i}/mlp", f"model.layers.{i}.mlp"
    gate = w.linear(x, matrix(f, f"blk.{i}.ffn_gate.weight"), f"{prefix}.gate_proj", f"{name}/gate_proj")
    up = w.linear(x, matrix(f, f"blk.{i}.ffn_up.weight"), f"{prefix}.up_proj", f"{name}/up_proj")
    sig = w.one("Sigmoid", [gate], f"{name}/act_fn/Sigmoid")
    act = w.one("Mul", [gate, sig], f"{name}/act_fn/Mul")
    hidden = w.one("Mul", [act, up], f"{name}/Mul")
    return w.linear(hidden, matrix(f, f"blk.{i}.ffn_down.weight"), f"{prefix}.down_proj", f"{name}/down_proj")


def _skip_norm(w: Writer, hp: Hparams, residual: str, delta: str, weight: str, name: str) -> tuple[str, str]:
    """(normed, residual + delta)."""
    outs = w.node(
        "SkipSimplifiedLayerNormalization",
        [residual, delta, weight],
        name,
        n_out=4,
        domain=MS,
        epsilon=hp.eps,
    )
    return outs[0], outs[3]


def _layer(
    w: Writer, f: GGUFFile, hp: Hparams, i: int, x: str, residual: str, lengths: tuple[str, str]
) -> tuple[str, str]:
    """Layer ``i`` from its normed input ``x``: (its MLP output, the residual stream before it)."""
    attn = _attention(w, f, hp, i, x, lengths)
    post = w.init(
        f"model.layers.{i}.post_attention_layernorm.weight", f.float_tensor(f"blk.{i}.ffn_norm.weight")
    )
    name = f"/model/layers.{i}/post_attention_layernorm/SkipLayerNorm"
    x, residual = _skip_norm(w, hp, residual, attn, post, name)
    return _mlp(w, f, i, x), residual


def _next_norm(w: Writer, f: GGUFFile, hp: Hparams, i: int, residual: str, delta: str) -> tuple[str, str]:
    """The norm after layer ``i - 1``: layer ``i``'s input norm, or the final norm after the last layer."""
    if i < hp.layers:
        weight, tensor = f"model.layers.{i}.input_layernorm.weight", f"blk.{i}.attn_norm.weight"
        name = f"/model/layers.{i}/input_layernorm/SkipLayerNorm"
    else:
        weight, tensor = f"model.layers.{i}.final_norm_layernorm.weight", "output_norm.weight"
        name = f"/model/layers.{i}/final_norm_layernorm/SkipLayerNorm"
    return _skip_norm(w, hp, residual, delta, w.init(weight, f.float_tensor(tensor)), name)


def build_model(
    f: GGUFFile, hp: Hparams, accuracy_level: int, weights: WeightFile | None = None
) -> onnx.ModelProto:
    """The whole decoder; its weights go to ``weights`` as they are made (None: inline)."""
    w = Writer(accuracy_level, weights)
    cos, sin = rope_tables(hp)
    w.init("cos_cache", cos)
    w.init("sin_cache", sin)
    lengths = mask_lengths(w)
    embed = matrix(f, "token_embd.weight")
    lm_prefix = "lm_head" if hp.tied else "model.embed_tokens"
    residual = w.embedding("input_ids", embed, lm_prefix)
    norm_w = w.init("model.layers.0.input_layernorm.weight", f.float_tensor("blk.0.attn_norm.weight"))
    x = w.one(
        "SimplifiedLayerNormalization",
        [residual, norm_w],
        "/model/layers.0/input_layernorm/LayerNorm",
        axis=-1,
        epsilon=hp.eps,
        stash_type=1,
    )
    for i in range(hp.layers):
        mlp, residual = _layer(w, f, hp, i, x, residual, lengths)
        x, residual = _next_norm(w, f, hp, i + 1, residual, mlp)
    head = embed if hp.tied else matrix(f, "output.weight")
    w.rename(w.linear(x, head, "lm_head", "/lm_head"), "logits")
    inputs, outputs = graph_io(hp)
    graph = helper.make_graph(w.nodes, "main_graph", inputs, outputs, list(w.inits.values()))
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, producer_name="onnxgen convert", ir_version=10)
