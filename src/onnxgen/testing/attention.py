"""Grouped-query causal self-attention with rotary positions and a KV cache, in three export forms.

One function of the weights (see :mod:`onnxgen.testing.reference`): non-interleaved RoPE on q and k
(``cos``/``sin`` tables [max_position, head_dim/2]), kv heads repeated to the query heads, scale
``head_dim**-0.5``, causal mask plus the padding mask from ``attention_mask``; the KV cache holds rotated
keys in ``[batch, kv_heads, seq, head_dim]``.

- :func:`attention_gqa`: ``com.microsoft::GroupQueryAttention`` (onnxruntime-genai builder). Rotary fused
  (``do_rotary=1``, positions from ``seqlens_k``) or applied outside by ``MRotaryEmbedding`` from rank-3
  ``position_ids`` (Qwen3.5 form). GQA reads only the *count* of ones in each mask row, so padded batches
  must be right-padded (the real builder's contract).
- :func:`attention_plain`: plain ONNX ops (optimum / torch export): Gather of the tables by position_ids,
  Concat for the growing cache, MatMul/Softmax with an additive mask (any padding).
- :func:`attention_onnx24`: opset-23 ``RotaryEmbedding`` + opset-24 ``Attention`` (mobius).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxgen.testing.dense import MS, Decoder, project
from onnxgen.testing.graph import onnx_dtype

MASKED = float(np.finfo(np.float32).min)


@dataclass(frozen=True)
class KVPorts:
    """Graph port names of one attention layer's cache."""

    layer: int
    past_key: str
    past_value: str
    present_key: str
    present_value: str

    @classmethod
    def standard(cls, layer: int) -> KVPorts:
        """``past_key_values.N.key/value`` -> ``present.N.key/value`` (every family uses these)."""
        return cls(
            layer,
            f"past_key_values.{layer}.key",
            f"past_key_values.{layer}.value",
            f"present.{layer}.key",
            f"present.{layer}.value",
        )


def rope_tables(head_dim: int, theta: float, max_position: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_position, head_dim/2] float32 of the non-interleaved rotary embedding."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _tables(d: Decoder) -> tuple[str, str]:
    s = d.spec
    cos, sin = rope_tables(s.head_dim, s.rope_theta, s.max_position)
    return d.table("rope.cos_cache", cos), d.table("rope.sin_cache", sin)


def gqa_lengths(d: Decoder, attention_mask: str) -> tuple[str, str]:
    """``seqlens_k`` = ReduceSum(mask, 1) - 1 and ``total_sequence_length`` = Shape(mask)[1], both int32."""
    b = d.b
    one = d.const([1])
    live = b.op1("Sub", [b.op1("ReduceSum", [attention_mask, one], keepdims=0), one])
    seqlens_k = b.op1("Cast", [live], out="seqlens_k", to=onnx_dtype("int32"))
    total = b.op1("Gather", [b.op1("Shape", [attention_mask]), d.const(np.int64(1))], axis=0)
    return seqlens_k, b.op1("Cast", [total], out="total_sequence_length", to=onnx_dtype("int32"))


def causal_bias(d: Decoder, attention_mask: str, input_ids: str) -> str:
    """Additive mask [batch, 1, seq, total]: 0 where key j <= query position and mask[j] == 1, else min."""
    b = d.b
    seq = b.op1("Squeeze", [b.op1("Shape", [input_ids], start=1, end=2)])
    total = b.op1("Squeeze", [b.op1("Shape", [attention_mask], start=1, end=2)])
    one = d.const(np.int64(1))
    q_pos = b.op1("Range", [b.op1("Sub", [total, seq]), total, one])
    k_pos = b.op1("Range", [d.const(np.int64(0)), total, one])
    causal = b.op1("LessOrEqual", [k_pos, b.op1("Unsqueeze", [q_pos, d.const([1])])])  # [S, T]
    live = b.op1(
        "Unsqueeze", [b.op1("Cast", [attention_mask], to=onnx_dtype("bool")), d.const([1, 2])]
    )  # [B, 1, 1, T]
    allowed = b.op1("And", [causal, live])
    return b.op1(
        "Where", [allowed, d.const(np.float32(0.0)), d.const(np.float32(MASKED))], out="attention_bias"
    )


def _qkv(d: Decoder, x: str, layer: int) -> tuple[str, str, str]:
    p = f"layers.{layer}.attn."
    return project(d, x, p + "q"), project(d, x, p + "k"), project(d, x, p + "v")


def mrope_section(head_dim: int) -> list[int]:
    """Sections [t, h, w] of the half head dim for MRotaryEmbedding (text rows are identical)."""
    side = head_dim // 8
    return [head_dim // 2 - 2 * side, side, side]


def attention_gqa(
    d: Decoder, x: str, layer: int, kv: KVPorts, lengths: tuple[str, str], position_ids: str | None = None
) -> str:
    """GroupQueryAttention; rotary fused unless rank-3 ``position_ids`` are given (then MRotaryEmbedding)."""
    s, b = d.spec, d.b
    q, k, v = _qkv(d, x, layer)
    cos, sin = _tables(d)
    rotary: dict[str, object] = {"do_rotary": 1, "rotary_interleaved": 0}
    extra = [cos, sin]
    if position_ids is not None:
        mrope: dict[str, Any] = {"mrope_section": mrope_section(s.head_dim), "mrope_layout": 1}
        q = b.op1("MRotaryEmbedding", [q, position_ids, cos, sin], domain=MS, num_heads=s.num_heads, **mrope)
        k = b.op1(
            "MRotaryEmbedding", [k, position_ids, cos, sin], domain=MS, num_heads=s.num_kv_heads, **mrope
        )
        rotary, extra = {"do_rotary": 0}, []
    out, _, _ = b.opn(
        "GroupQueryAttention",
        [q, k, v, kv.past_key, kv.past_value, *lengths, *extra],
        [None, kv.present_key, kv.present_value],
        domain=MS,
        num_heads=s.num_heads,
        kv_num_heads=s.num_kv_heads,
        **rotary,
    )
    return project(d, out, f"layers.{layer}.attn.o")


def _heads(d: Decoder, t: str, heads: int) -> str:
    """[B, S, heads*hd] -> [B, heads, S, hd]."""
    r = d.b.op1("Reshape", [t, d.const([0, 0, heads, d.spec.head_dim])])
    return d.b.op1("Transpose", [r], perm=[0, 2, 1, 3])


def _rotate(d: Decoder, t: str, cos: str, sin: str) -> str:
    """``t * cos + rotate_half(t) * sin`` on [B, H, S, hd] with cos/sin [B, 1, S, hd]."""
    b, half = d.b, d.spec.head_dim // 2
    x1, x2 = b.opn("Split", [t, d.const([half, half])], [None, None], axis=-1)
    rotated = b.op1("Concat", [b.op1("Neg", [x2]), x1], axis=-1)
    return b.op1("Add", [b.op1("Mul", [t, cos]), b.op1("Mul", [rotated, sin])])


def _positions_table(d: Decoder, table: str, position_ids: str) -> str:
    """Rows of a [max_position, hd/2] table at ``position_ids`` [B, S], doubled to [B, 1, S, hd]."""
    rows = d.b.op1("Gather", [table, position_ids], axis=0)
    return d.b.op1("Unsqueeze", [d.b.op1("Concat", [rows, rows], axis=-1), d.const([1])])


def _repeat_kv(d: Decoder, t: str) -> str:
    """[B, kvh, T, hd] -> [B, heads, T, hd], each kv head repeated heads/kvh times (torch repeat_kv)."""
    s = d.spec
    rep = s.num_heads // s.num_kv_heads
    if rep == 1:
        return t
    u = d.b.op1("Unsqueeze", [t, d.const([2])])
    tiled = d.b.op1("Concat", [u] * rep, axis=2)
    return d.b.op1("Reshape", [tiled, d.const([0, s.num_heads, -1, s.head_dim])])


def attention_plain(d: Decoder, x: str, layer: int, kv: KVPorts, position_ids: str, bias: str) -> str:
    """Plain-op attention; ``position_ids`` [B, S], ``bias`` from :func:`causal_bias`."""
    s, b = d.spec, d.b
    qp, kp, vp = _qkv(d, x, layer)
    q, k, v = _heads(d, qp, s.num_heads), _heads(d, kp, s.num_kv_heads), _heads(d, vp, s.num_kv_heads)
    cos, sin = (_positions_table(d, t, position_ids) for t in _tables(d))
    q, k = _rotate(d, q, cos, sin), _rotate(d, k, cos, sin)
    keys = b.op1("Concat", [kv.past_key, k], axis=2, out=kv.present_key)
    values = b.op1("Concat", [kv.past_value, v], axis=2, out=kv.present_value)
    kt = b.op1("Transpose", [_repeat_kv(d, keys)], perm=[0, 1, 3, 2])
    scores = b.op1("Mul", [b.op1("MatMul", [q, kt]), d.const(np.float32(s.head_dim**-0.5))])
    probs = b.op1("Softmax", [b.op1("Add", [scores, bias])], axis=-1)
    ctx = b.op1("Transpose", [b.op1("MatMul", [probs, _repeat_kv(d, values)])], perm=[0, 2, 1, 3])
    flat = b.op1("Reshape", [ctx, d.const([0, 0, s.num_heads * s.head_dim])])
    return project(d, flat, f"layers.{layer}.attn.o")


def attention_onnx24(d: Decoder, x: str, layer: int, kv: KVPorts, position_ids: str, bias: str) -> str:
    """Opset-23 RotaryEmbedding + opset-24 Attention with the cache; ``position_ids`` [B, S]."""
    s, b = d.spec, d.b
    q, k, v = _qkv(d, x, layer)
    cos, sin = _tables(d)
    q = b.op1("RotaryEmbedding", [q, cos, sin, position_ids], num_heads=s.num_heads)
    k = b.op1("RotaryEmbedding", [k, cos, sin, position_ids], num_heads=s.num_kv_heads)
    out, _, _ = b.opn(
        "Attention",
        [q, k, v, bias, kv.past_key, kv.past_value],
        [None, kv.present_key, kv.present_value],
        q_num_heads=s.num_heads,
        kv_num_heads=s.num_kv_heads,
    )
    return project(d, out, f"layers.{layer}.attn.o")


def unstack_kv(d: Decoder, stacked: KVPorts) -> KVPorts:
    """A GPT-2 style stacked cache ``past_N`` [2, B, kvh, S, hd] as a key and a value past for any attention
    form: returns ports whose pasts are ``past_N[0]`` / ``past_N[1]`` and whose presents are fresh names
    that :func:`restack_kv` joins into ``present_N``."""
    b = d.b
    key = b.op1("Gather", [stacked.past_key, d.const(np.int64(0))], axis=0)
    value = b.op1("Gather", [stacked.past_key, d.const(np.int64(1))], axis=0)
    return KVPorts(stacked.layer, key, value, b.fresh("present_key"), b.fresh("present_value"))


def restack_kv(d: Decoder, ports: KVPorts, present: str) -> None:
    """``present`` = [present key, present value] stacked on a new axis 0."""
    axis = d.const([0])
    key, value = (d.b.op1("Unsqueeze", [name, axis]) for name in (ports.present_key, ports.present_value))
    d.b.op1("Concat", [key, value], axis=0, out=present)


@dataclass(frozen=True)
class StaticInputs:
    """The graph inputs of a static cache: where each row writes (``write_indices`` [B]) and how many of its
    positions are live after the forward (``lengths`` [B], ``nonpad_kv_seqlen``), both int64 in the body."""

    write_indices: str
    lengths: str


def static_bias(d: Decoder, input_ids: str, inputs: StaticInputs) -> str:
    """Additive mask [B, 1, S, max_position] of a static cache: key j is seen by query i of row b when
    ``j <= write_indices[b] + i`` and ``j < lengths[b]``."""
    b = d.b
    seq = b.op1("Squeeze", [b.op1("Shape", [input_ids], start=1, end=2)])
    one = d.const(np.int64(1))
    steps = b.op1("Range", [d.const(np.int64(0)), seq, one])  # [S]
    rows = b.op1("Unsqueeze", [inputs.write_indices, d.const([1])])  # [B, 1]
    q_pos = b.op1("Unsqueeze", [b.op1("Add", [rows, steps]), d.const([2])])  # [B, S, 1]
    k_pos = d.const(np.arange(d.spec.max_position, dtype=np.int64))  # [T]
    causal = b.op1("LessOrEqual", [k_pos, q_pos])  # [B, S, T]
    live = b.op1("Less", [k_pos, b.op1("Unsqueeze", [inputs.lengths, d.const([1, 2])])])  # [B, 1, T]
    allowed = b.op1("Unsqueeze", [b.op1("And", [causal, live]), d.const([1])])
    return b.op1("Where", [allowed, d.const(np.float32(0.0)), d.const(np.float32(MASKED))])


def _flat(d: Decoder, t: str) -> str:
    """[B, heads, S, hd] -> [B, S, heads*hd]."""
    return d.b.op1("Reshape", [d.b.op1("Transpose", [t], perm=[0, 2, 1, 3]), d.const([0, 0, -1])])


def attention_static(
    d: Decoder,
    x: str,
    layer: int,
    kv: KVPorts,
    position_ids: str,
    inputs: StaticInputs,
    bias: str | None,
) -> str:
    """Attention over a static cache ``[B, max_position, kv_heads*head_dim]`` (mobius ``--static-cache``): the
    new keys and values are written at ``write_indices`` with ``TensorScatter`` (axis 1), then read back
    whole. With ``bias`` (from :func:`static_bias`) in plain ops, else with opset-24 ``Attention`` and its
    ``nonpad_kv_seqlen`` input."""
    s, b = d.spec, d.b
    q, k, v = _qkv(d, x, layer)
    cos, sin = _tables(d)
    if bias is None:
        q = b.op1("RotaryEmbedding", [q, cos, sin, position_ids], num_heads=s.num_heads)
        k = b.op1("RotaryEmbedding", [k, cos, sin, position_ids], num_heads=s.num_kv_heads)
    else:
        cos4, sin4 = (_positions_table(d, t, position_ids) for t in (cos, sin))
        q = _rotate(d, _heads(d, q, s.num_heads), cos4, sin4)
        k = _flat(d, _rotate(d, _heads(d, k, s.num_kv_heads), cos4, sin4))
    keys = b.op1("TensorScatter", [kv.past_key, k, inputs.write_indices], axis=1, out=kv.present_key)
    values = b.op1("TensorScatter", [kv.past_value, v, inputs.write_indices], axis=1, out=kv.present_value)
    if bias is None:
        out = b.op1(
            "Attention",
            [q, keys, values, "", "", "", inputs.lengths],
            is_causal=1,
            q_num_heads=s.num_heads,
            kv_num_heads=s.num_kv_heads,
        )
        return project(d, out, f"layers.{layer}.attn.o")
    kt = b.op1("Transpose", [_repeat_kv(d, _heads(d, keys, s.num_kv_heads))], perm=[0, 1, 3, 2])
    scores = b.op1("Mul", [b.op1("MatMul", [q, kt]), d.const(np.float32(s.head_dim**-0.5))])
    probs = b.op1("Softmax", [b.op1("Add", [scores, bias])], axis=-1)
    ctx = b.op1("MatMul", [probs, _repeat_kv(d, _heads(d, values, s.num_kv_heads))])
    return project(d, _flat(d, ctx), f"layers.{layer}.attn.o")
