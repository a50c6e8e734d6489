"""The MTP head as an ONNX graph (onnx-ir), in onnxruntime-genai's ``mtp.onnx`` I/O naming.

Inputs: ``input_ids`` ``[batch, seq]`` (entry i's token: the one after position i), ``hidden_states``
``[batch, seq, hidden]`` (the target's final hidden state at position i, or the head's own output when
drafting ahead), ``attention_mask`` ``[batch, total]``, ``position_ids`` ``[batch, seq]``,
``past_key_values.0.key/value`` ``[batch, kv_heads, past, head_dim]``. Outputs: ``logits``,
``hidden_states_out`` (the head's normed output: the lm_head's input and the next chained step's hidden
state), ``present.0.key/value``.

Math (:func:`onnxgen.testing.mtp.mtp_reference` is its NumPy twin): ``x = fc(concat(rms(embed(ids)),
rms(hidden)))``; ``x += o_proj(attn(rms(x)) * sigmoid(gate))`` with the query's output gate interleaved per
head in ``q_proj``, per-head RMS norms on query and key, rotary over each head's first ``rotary_dim``
dims; ``x += down(silu(gate(rms(x))) * up(rms(x)))``; ``y = rms(x)``; ``logits = lm_head(y)``. Every norm
multiplies by ``1 + weight`` (the checkpoints' zero-centred norms; the ``1 +`` is folded into the stored
weight). The embedding and lm_head nodes are copies of the decoder's (:class:`Borrowed`), reading the
decoder's own initializers.

The graph is laid out for few onnxruntime nodes, since a head forward over a token or two costs mostly
per-node work: one projection for query, key, gate and value and one for the MLP's gate and up (each
output column computed from its own weight row, as in separate projections), one normalization over
the query and key heads together, ``SkipSimplifiedLayerNormalization`` for each residual add and the
norm after it, and ``com.microsoft::GroupQueryAttention`` applying the rotary embedding itself
(``do_rotary`` with cos/sin caches; rotary nodes on the position ids where onnxruntime's kernel does not
take the width). Past and present share one buffer, so rewinding the head's cache is a length change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxgen.export.mtp_weights import LAYER, MTPGeometry
from onnxgen.graph.int4_lm_head import BLOCK_SIZE

MS = "com.microsoft"
OPSET = 23  # RMSNormalization

# ports (onnxruntime-genai's mtp.onnx names)
TOKENS, HIDDEN_IN, MASK, POSITIONS = "input_ids", "hidden_states", "attention_mask", "position_ids"
PAST_KEY, PAST_VALUE = "past_key_values.0.key", "past_key_values.0.value"
LOGITS, HIDDEN_OUT = "logits", "hidden_states_out"
PRESENT_KEY, PRESENT_VALUE = "present.0.key", "present.0.value"


@dataclass(frozen=True)
class Transposed:
    """An initializer the decoder reads through a ``Transpose`` (a tied embedding table: the lm_head's
    ``[hidden, vocab]`` weight read as ``[vocab, hidden]``); the head repeats the Transpose."""

    tensor: ir.TensorProtocol
    perm: Sequence[int]


@dataclass(frozen=True)
class Borrowed:
    """A decoder node the head runs as it is (the embedding lookup, the lm_head): its op and attributes,
    and its inputs: ``None`` for the one the head feeds, else an initializer tensor (shared or copied),
    possibly read through a Transpose."""

    op_type: str
    domain: str
    attributes: Sequence[ir.Attr]
    inputs: Sequence[ir.TensorProtocol | Transposed | None]

    def apply(self, b: _Builder, data: ir.Value) -> ir.Value:
        args = [data if t is None else _read(b, t) for t in self.inputs]
        return b.node(
            ir.Node(self.domain, self.op_type, args, attributes=list(self.attributes), num_outputs=1)
        )[0]


@dataclass(frozen=True)
class RotaryCaches:
    """GroupQueryAttention's ``cos_cache`` and ``sin_cache`` ``[positions, rotary_dim / 2]``: the decoder's
    own where they hold the head's rotary embedding (shared like the embedding), else the head's."""

    cos: ir.TensorProtocol
    sin: ir.TensorProtocol

    @classmethod
    def of(cls, g: MTPGeometry, rows: int) -> RotaryCaches:
        cos, sin = rotary_tables(g, rows)
        return cls(ir.tensor(cos, name="mtp.cos_cache"), ir.tensor(sin, name="mtp.sin_cache"))


def _read(b: _Builder, t: ir.TensorProtocol | Transposed) -> ir.Value:
    if isinstance(t, Transposed):
        return b.op("Transpose", [b.initializer(t.tensor)], perm=list(t.perm))
    return b.initializer(t)


Quantize = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # [K, N] -> packed [N, blocks, 16], scales


class _Builder:
    """Nodes and initializers of the head, with the projections in fp32 or int4."""

    def __init__(self, quantize: Quantize | None, accuracy_level: int) -> None:
        self.nodes: list[ir.Node] = []
        self.quantize = quantize
        self.accuracy_level = accuracy_level
        self.initializers: dict[int, ir.Value] = {}

    def node(self, node: ir.Node) -> Sequence[ir.Value]:
        self.nodes.append(node)
        return node.outputs

    def ops(
        self, op_type: str, inputs: Sequence[ir.Value], n: int, domain: str = "", **attrs: object
    ) -> Sequence[ir.Value]:
        attributes = ir.convenience.convert_attributes(attrs)  # type: ignore[arg-type]
        return self.node(ir.Node(domain, op_type, inputs, attributes=attributes, num_outputs=n))

    def op(self, op_type: str, inputs: Sequence[ir.Value], domain: str = "", **attrs: object) -> ir.Value:
        return self.ops(op_type, inputs, 1, domain, **attrs)[0]

    def initializer(self, tensor: ir.TensorProtocol) -> ir.Value:
        """The initializer holding ``tensor`` (one per tensor object)."""
        key = id(tensor)
        if key not in self.initializers:
            self.initializers[key] = ir.Value(
                name=tensor.name,
                # onnx_ir declares a tensor's shape as ShapeProtocol; its tensors hold an ir.Shape, as Value takes
                shape=tensor.shape,  # type: ignore[arg-type]
                type=ir.TensorType(tensor.dtype),
                const_value=tensor,
            )
        return self.initializers[key]

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        return self.initializer(ir.tensor(np.ascontiguousarray(array), name=name))

    def project(self, x: ir.Value, name: str, weight: np.ndarray) -> ir.Value:
        """``x @ weight.T`` for a torch ``[out, in]`` weight: MatMul, or MatMulNBits when quantizing."""
        w = np.ascontiguousarray(weight.T, dtype=np.float32)  # [K, N]
        if self.quantize is None:
            return self.op("MatMul", [x, self.const(name, w)])
        packed, scales = self.quantize(w)
        k, n = w.shape
        return self.op(
            "MatMulNBits",
            [x, self.const(name + "_Q4", packed), self.const(name + "_scales", scales.reshape(-1))],
            domain=MS,
            K=k,
            N=n,
            bits=4,
            block_size=BLOCK_SIZE,
            accuracy_level=self.accuracy_level,
        )

    def rms(self, x: ir.Value, name: str, weight: np.ndarray, eps: float) -> ir.Value:
        scale = self.const(name, (1.0 + weight).astype(np.float32))
        return self.op("RMSNormalization", [x, scale], axis=-1, epsilon=float(eps))

    def skip_rms(
        self, x: ir.Value, skip: ir.Value, name: str, weight: np.ndarray, eps: float
    ) -> tuple[ir.Value, ir.Value]:
        """``rms(x + skip)`` and ``x + skip`` in one ``SkipSimplifiedLayerNormalization``."""
        scale = self.const(name, (1.0 + weight).astype(np.float32))
        normed, mean, inv_std, total = self.ops(
            "SkipSimplifiedLayerNormalization", [x, skip, scale], 4, domain=MS, epsilon=float(eps)
        )
        mean.name = inv_std.name = ""  # optional outputs left out: the kernel does not write them
        return normed, total


def _ints(b: _Builder, name: str, values: Sequence[int]) -> ir.Value:
    return b.const(name, np.asarray(values, dtype=np.int64))


def rotary_tables(g: MTPGeometry, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[rows, rotary_dim / 2]`` (float32) of the rotary embedding at positions 0..rows-1:
    GroupQueryAttention's ``cos_cache`` / ``sin_cache``."""
    inv = g.rope_theta ** (-np.arange(0, g.rotary_dim, 2, dtype=np.float64) / g.rotary_dim)
    angles = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def fused_rotary_fits(g: MTPGeometry) -> bool:
    """Whether GroupQueryAttention can apply the head's rotary embedding itself: onnxruntime's kernel
    takes rotary widths that are multiples of 16 (``cos_cache`` columns a multiple of 8)."""
    return g.rotary_dim % 16 == 0 and 0 < g.rotary_dim <= g.head_dim


def _rotary(b: _Builder, g: MTPGeometry, positions: ir.Value) -> tuple[ir.Value, ir.Value]:
    """cos and sin ``[batch, seq, 1, rotary_dim]`` of the rotary embedding at ``positions``."""
    inv = g.rope_theta ** (-np.arange(0, g.rotary_dim, 2, dtype=np.float64) / g.rotary_dim)
    pos = b.op(
        "Unsqueeze", [b.op("Cast", [positions], to=ir.DataType.FLOAT), _ints(b, "rope.axis_last", [-1])]
    )
    freqs = b.op("Mul", [pos, b.const("rope.inv_freq", inv.astype(np.float32))])
    axis2 = _ints(b, "rope.axis_head", [2])
    cos = b.op("Unsqueeze", [b.op("Concat", [b.op("Cos", [freqs])] * 2, axis=-1), axis2])
    sin = b.op("Unsqueeze", [b.op("Concat", [b.op("Sin", [freqs])] * 2, axis=-1), axis2])
    return cos, sin


def _rotate(b: _Builder, g: MTPGeometry, x: ir.Value, positions: ir.Value) -> ir.Value:
    """Rotary on the first ``rotary_dim`` of each head of ``x`` ``[batch, seq, heads, head_dim]``."""
    cos, sin = _rotary(b, g, positions)
    rd, half = g.rotary_dim, g.rotary_dim // 2
    rest = None
    if rd < g.head_dim:
        x, rest = b.ops("Split", [x, _ints(b, "rope.split", [rd, g.head_dim - rd])], 2, axis=-1)
    x1, x2 = b.ops("Split", [x, _ints(b, "rope.halves", [half, half])], 2, axis=-1)
    turned = b.op("Concat", [b.op("Neg", [x2]), x1], axis=-1)
    rotated = b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [turned, sin])])
    return rotated if rest is None else b.op("Concat", [rotated, rest], axis=-1)


def _qkv_weight(g: MTPGeometry, w: Mapping[str, np.ndarray]) -> np.ndarray:
    """q_proj, k_proj and v_proj as one ``[out, in]`` weight whose rows are every head's query, the key,
    every head's output gate, then the value: the query and key heads come out side by side for one
    normalization, and the gate and value as they are read. ``q_proj`` interleaves query and gate per
    head; rows are only reordered, so each output column (and its int4 blocks) is the one it was."""
    p, hd = LAYER + "self_attn.", g.head_dim
    qg = w[p + "q_proj.weight"].reshape(g.heads, 2, hd, g.hidden)
    q, gate = qg[:, 0].reshape(-1, g.hidden), qg[:, 1].reshape(-1, g.hidden)
    return np.concatenate([q, w[p + "k_proj.weight"], gate, w[p + "v_proj.weight"]])


def _attention(
    b: _Builder,
    g: MTPGeometry,
    w: Mapping[str, np.ndarray],
    x: ir.Value,
    rotary: RotaryCaches | ir.Value,
    lengths: tuple[ir.Value, ir.Value],
    past: tuple[ir.Value, ir.Value],
) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Gated attention of the head's layer; returns (output, present key, present value).

    One projection yields query, key, gate and value; the query and key heads are normalized together
    (weight 1, then a ``Mul`` by each head's own norm weight); GroupQueryAttention applies the rotary
    embedding (``do_rotary``, over the first ``2 * cos_cache.shape[1]`` dims of each head) from its
    caches at the positions its cache lengths give. Where it cannot (``rotary`` is then the position
    ids), the rotary nodes turn the query and key heads together before attention."""
    p, hd = LAYER + "self_attn.", g.head_dim
    q_dim, kv_dim = g.heads * hd, g.kv_heads * hd
    qk, gate, v = b.ops(
        "Split",
        [
            b.project(x, p + "qkv_proj", _qkv_weight(g, w)),
            _ints(b, "attn.qkv_split", [q_dim + kv_dim, q_dim, kv_dim]),
        ],
        3,
        axis=-1,
    )
    heads = b.op("Reshape", [qk, _ints(b, "attn.qk_heads", [0, 0, g.heads + g.kv_heads, hd])])
    per_head = np.concatenate(
        [np.tile(w[p + "q_norm.weight"], (g.heads, 1)), np.tile(w[p + "k_norm.weight"], (g.kv_heads, 1))]
    )
    normed = b.op(
        "Mul",
        [
            b.op(
                "RMSNormalization",
                [heads, b.const("attn.qk_norm.one", np.ones(hd, np.float32))],
                axis=-1,
                epsilon=float(g.rms_eps),
            ),
            b.const(p + "qk_norm.weight", (1.0 + per_head).astype(np.float32)),
        ],
    )
    if isinstance(rotary, ir.Value):
        normed = _rotate(b, g, normed, rotary)
    flat = b.op("Reshape", [normed, _ints(b, "attn.flat", [0, 0, -1])])
    q, k = b.ops("Split", [flat, _ints(b, "attn.qk_split", [q_dim, kv_dim])], 2, axis=-1)
    fused = isinstance(rotary, RotaryCaches)
    caches = (
        [b.initializer(rotary.cos), b.initializer(rotary.sin)] if isinstance(rotary, RotaryCaches) else []
    )
    out, present_key, present_value = b.ops(
        "GroupQueryAttention",
        [q, k, v, past[0], past[1], lengths[0], lengths[1], *caches],
        3,
        domain=MS,
        num_heads=g.heads,
        kv_num_heads=g.kv_heads,
        scale=float(hd**-0.5),
        do_rotary=int(fused),
        rotary_interleaved=0,
    )
    gated = b.op("Mul", [out, b.op("Sigmoid", [gate])])
    return b.project(gated, p + "o_proj", w[p + "o_proj.weight"]), present_key, present_value


def _lengths(b: _Builder, mask: ir.Value) -> tuple[ir.Value, ir.Value]:
    """GroupQueryAttention's ``seqlens_k`` (live tokens - 1, per row) and ``total_sequence_length``."""
    one = _ints(b, "mask.one", [1])
    live = b.op("Sub", [b.op("ReduceSum", [mask, one], keepdims=0), one])
    total = b.op("Gather", [b.op("Shape", [mask]), b.const("mask.axis", np.array(1, dtype=np.int64))], axis=0)
    return b.op("Cast", [live], to=ir.DataType.INT32), b.op("Cast", [total], to=ir.DataType.INT32)


def _port(name: str, dtype: ir.DataType, dims: Sequence[int | str]) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(dims)))


def build_mtp_graph(
    g: MTPGeometry,
    weights: Mapping[str, np.ndarray],
    embedding: Borrowed,
    lm_head: Borrowed,
    rotary: RotaryCaches | None,
    quantize: Quantize | None = None,
    accuracy_level: int = 4,
) -> ir.Model:
    """The head's model; ``quantize`` (None: fp32) turns its own projections into int4 MatMulNBits.
    ``rotary``: GroupQueryAttention's caches, or None for rotary nodes on the position ids (widths
    :func:`fused_rotary_fits` refuses)."""
    f32 = ir.DataType.FLOAT
    kv_dims: list[int | str] = ["batch_size", g.kv_heads, "past_sequence_length", g.head_dim]
    inputs = [
        _port(TOKENS, ir.DataType.INT64, ["batch_size", "sequence_length"]),
        _port(HIDDEN_IN, f32, ["batch_size", "sequence_length", g.hidden]),
        _port(MASK, ir.DataType.INT64, ["batch_size", "total_sequence_length"]),
        _port(POSITIONS, ir.DataType.INT64, ["batch_size", "sequence_length"]),
        _port(PAST_KEY, f32, kv_dims),
        _port(PAST_VALUE, f32, kv_dims),
    ]
    # with the rotary inside GroupQueryAttention, position_ids stays a port (onnxruntime-genai's I/O)
    # unread: the kernel takes each entry's position from the cache length (entry i is at position i)
    ids, hidden, mask, positions, past_key, past_value = inputs
    b = _Builder(quantize, accuracy_level)
    w = weights
    e = b.rms(
        embedding.apply(b, ids),
        "mtp.pre_fc_norm_embedding.weight",
        w["mtp.pre_fc_norm_embedding.weight"],
        g.rms_eps,
    )
    h = b.rms(hidden, "mtp.pre_fc_norm_hidden.weight", w["mtp.pre_fc_norm_hidden.weight"], g.rms_eps)
    x = b.project(b.op("Concat", [e, h], axis=-1), "mtp.fc", w["mtp.fc.weight"])  # embedding first
    a = b.rms(x, LAYER + "input_layernorm.weight", w[LAYER + "input_layernorm.weight"], g.rms_eps)
    attn, present_key, present_value = _attention(
        b, g, w, a, positions if rotary is None else rotary, _lengths(b, mask), (past_key, past_value)
    )
    m, x = b.skip_rms(
        x,
        attn,
        LAYER + "post_attention_layernorm.weight",
        w[LAYER + "post_attention_layernorm.weight"],
        g.rms_eps,
    )
    gate_up = np.concatenate([w[LAYER + "mlp.gate_proj.weight"], w[LAYER + "mlp.up_proj.weight"]])
    gate, up = b.ops(
        "Split",
        [b.project(m, LAYER + "mlp.gate_up_proj", gate_up), _ints(b, "mlp.split", [g.intermediate] * 2)],
        2,
        axis=-1,
    )
    act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
    down = b.project(act, LAYER + "mlp.down_proj", w[LAYER + "mlp.down_proj.weight"])
    y, _ = b.skip_rms(x, down, "mtp.norm.weight", w["mtp.norm.weight"], g.rms_eps)
    logits = lm_head.apply(b, y)
    outputs: list[tuple[ir.Value, str, list[int | str]]] = [
        (y, HIDDEN_OUT, ["batch_size", "sequence_length", g.hidden]),
        (logits, LOGITS, ["batch_size", "sequence_length", g.vocab]),
        (present_key, PRESENT_KEY, ["batch_size", g.kv_heads, "total_sequence_length", g.head_dim]),
        (present_value, PRESENT_VALUE, ["batch_size", g.kv_heads, "total_sequence_length", g.head_dim]),
    ]
    for value, name, dims in outputs:
        value.name, value.type, value.shape = name, ir.TensorType(f32), ir.Shape(dims)
    graph = ir.Graph(
        inputs,
        [logits, y, present_key, present_value],
        nodes=b.nodes,
        initializers=list(b.initializers.values()),
        opset_imports={"": OPSET, MS: 1},
        name="mtp_head",
    )
    return ir.Model(graph, ir_version=10, producer_name="onnxgen export-mtp")


__all__ = [
    "HIDDEN_IN",
    "HIDDEN_OUT",
    "LOGITS",
    "Borrowed",
    "RotaryCaches",
    "Transposed",
    "build_mtp_graph",
    "fused_rotary_fits",
    "rotary_tables",
]
