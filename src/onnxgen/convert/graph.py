"""The decoder graph of a GGUF model, in onnxruntime-genai's builder layout.

The layout is the builder's, so that onnxgen's fast paths (and onnxruntime-genai) apply unchanged:
``input_ids`` / ``attention_mask`` / ``past_key_values.%d.key|value`` in, ``logits`` /
``present.%d.key|value`` out; ``GroupQueryAttention`` with fused rotate-half RoPE over ``cos_cache`` /
``sin_cache``; ``SkipSimplifiedLayerNormalization`` between sublayers; ``MatMulNBits`` for quantized
projections and ``GatherBlockQuantized`` for a quantized embedding. Activations are float32.

A projection's GGUF blocks become one ``MatMulNBits`` with integer zero points (the forms onnxruntime's CPU
kernels run fast; :class:`~onnxgen.convert.blocks.KernelWeights`): 4-bit types as they are; 8-bit ones kept
8-bit at accuracy level 4 (int8 activations), else as their high and low halves over twice the columns,
fed ``[x, x]``; offsets, where the type has them, added beside the kernel as ``sum over blocks of offset *
(sum of the block's inputs)``.

A quantized embedding gathers the same packed integers, scales and zero points (tied embeddings share the
lm_head's initializers), sums an 8-bit type's two halves, and adds its offsets from a ``[vocab, blocks]``
table, so an embedding row equals GGUF's dequantized row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgen.convert.blocks import Blocks, KernelWeights
from onnxgen.convert.reader import Hparams
from onnxgen.convert.weights import Matrix

OPSET = 21
INT8_ACTIVATIONS = 4  # MatMulNBits accuracy_level
MS = "com.microsoft"


ALIGN = 4096  # onnxruntime maps an external tensor whose offset is page aligned instead of copying it


class WeightFile:
    """Initializers appended to one open file at page-aligned offsets, as they are made (a converted
    model's weights never sit in memory all at once); tensors under :data:`ALIGN` bytes stay inline."""

    def __init__(self, fh: BinaryIO, location: str) -> None:
        self.fh, self.location, self.offset = fh, location, 0

    def store(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        if array.nbytes < ALIGN:
            return numpy_helper.from_array(array, name)
        pad = -self.offset % ALIGN
        data = array.tobytes()
        self.fh.write(b"\0" * pad + data)
        start, self.offset = self.offset + pad, self.offset + pad + len(data)
        out = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        out.dims.extend(array.shape)
        out.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(len(data)))):
            out.external_data.add(key=key, value=value)
        return out


@dataclass
class Writer:
    """Collects nodes and initializers of one graph (initializers through ``weights`` when given)."""

    accuracy_level: int
    weights: WeightFile | None = None
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: dict[str, onnx.TensorProto] = field(default_factory=dict)
    _consts: dict[tuple, str] = field(default_factory=dict)

    def init(self, name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        self.inits[name] = (
            self.weights.store(name, array) if self.weights else numpy_helper.from_array(array, name)
        )
        return name

    def ints(self, values: list[int]) -> str:
        """An int64 constant, one initializer per distinct value list."""
        key = ("i64", *values)
        if key not in self._consts:
            self._consts[key] = self.init(f"/model/constants/INT64/{values}", np.array(values, np.int64))
        return self._consts[key]

    def scalar(self, value: int) -> str:
        key = ("i64 scalar", value)
        if key not in self._consts:
            self._consts[key] = self.init(f"/model/constants/INT64/{value}", np.array(value, np.int64))
        return self._consts[key]

    def node(
        self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", **attrs
    ) -> list[str]:
        outputs = [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def rename(self, old: str, new: str) -> None:
        """Call the node output ``old`` ``new`` (a graph output's name)."""
        for node in self.nodes:
            node.output[:] = [new if o == old else o for o in node.output]
            node.input[:] = [new if i == old else i for i in node.input]

    def one(self, op: str, inputs: list[str], name: str, domain: str = "", **attrs) -> str:
        return self.node(op, inputs, name, 1, domain, **attrs)[0]

    # -- projections ------------------------------------------------------------------------------------

    def linear(self, x: str, m: Matrix, prefix: str, name: str) -> str:
        """``x @ m.T`` for ``m`` ``[N, K]``: MatMulNBits for blocks, MatMul for float."""
        if isinstance(m, np.ndarray):
            w = self.init(f"{prefix}.MatMul.weight", m.T)
            return self.one("MatMul", [x, w], f"{name}/MatMul")
        n, k = m.shape
        q = self.kernel_weights(m)
        source = self.twice(x) if q.split else x
        y = self.one(
            "MatMulNBits",
            [source, *self.weight_inits(q, prefix)],
            f"{name}/MatMul_Q{q.bits}",
            domain=MS,
            K=q.ints.shape[1],
            N=n,
            bits=q.bits,
            block_size=q.block,
            accuracy_level=self.accuracy_level,
        )
        if q.offsets is not None:
            y = self.one("Add", [y, self.offset_term(x, q, k, prefix, name)], f"{name}/AddOffsets")
        return y

    def twice(self, x: str) -> str:
        """``[x, x]`` along the last axis, once per ``x`` (the input of split 8-bit projections)."""
        key = ("twice", x)
        if key not in self._consts:
            self._consts[key] = self.one("Concat", [x, x], f"{x}/Twice", axis=-1)
        return self._consts[key]

    def kernel_weights(self, m: Blocks) -> KernelWeights:
        """``m`` as MatMulNBits inputs: 8-bit integers stay 8-bit where activations are int8 (level 4;
        onnxruntime's 8-bit kernels are fast there only), else split in 4-bit halves."""
        return m.kernel_weights(split_bytes=self.accuracy_level != INT8_ACTIVATIONS)

    def weight_inits(self, q: KernelWeights, prefix: str) -> list[str]:
        """B ``[N, blocks, block * bits / 8]``, scales ``[N, blocks]`` and zero points, made once per prefix."""
        names = [f"{prefix}.MatMul.weight_Q{q.bits}", f"{prefix}.MatMul.weight_scales"]
        if q.zero_points is not None:
            names.append(f"{prefix}.MatMul.weight_zp")
        if names[0] not in self.inits:
            self.init(names[0], q.packed())
            self.init(names[1], q.scales)
            zp = q.packed_zero_points()
            if zp is not None:
                self.init(names[2], zp)
        return names

    def offset_term(self, x: str, q: KernelWeights, k: int, prefix: str, name: str) -> str:
        """``sum_b offsets[:, b] * sum(x over block b)``: the offsets' share of ``x @ w.T``."""
        table = self.init(f"{prefix}.MatMul.weight_offsets", q.offsets.T)  # type: ignore[union-attr]
        return self.one("MatMul", [self.block_sums(x, k, q.block), table], f"{name}/Offsets/MatMul")

    def block_sums(self, x: str, k: int, block: int) -> str:
        """``x`` ``[batch, seq, k]`` summed over each block of ``block`` inputs, once per ``x``."""
        key = ("sums", x, block)
        if key not in self._consts:
            blocks = self.one("Reshape", [x, self.ints([0, 0, k // block, block])], f"{x}/BlockSums/Reshape")
            sums = self.one("ReduceSum", [blocks, self.ints([-1])], f"{x}/BlockSums/ReduceSum", keepdims=0)
            self._consts[key] = sums
        return self._consts[key]

    # -- embedding --------------------------------------------------------------------------------------

    def embedding(self, ids: str, m: Matrix, prefix: str) -> str:
        """Rows ``ids`` of ``m`` ``[vocab, hidden]``; quantized ``m`` shares ``prefix``'s initializers."""
        name = "/model/embed_tokens"
        if isinstance(m, np.ndarray):
            table = self.init("model.embed_tokens.weight", m)
            return self.one("Gather", [table, ids], f"{name}/Gather")
        vocab, hidden = m.shape
        q = self.kernel_weights(m)
        packed, *rest = self.weight_inits(q, prefix)
        width = q.ints.shape[1] * q.bits // 8
        data = self.one("Reshape", [packed, self.ints([vocab, width])], f"{name}/Reshape")
        attrs = {"bits": q.bits, "block_size": q.block, "gather_axis": 0, "quantize_axis": 1}
        rows = self.one(
            "GatherBlockQuantized", [data, ids, *rest], f"{name}/GatherBlockQuantized", domain=MS, **attrs
        )
        if q.split:  # [high part | low part] -> their sum
            halves = self.one("Reshape", [rows, self.ints([0, 0, 2, hidden])], f"{name}/Halves")
            rows = self.one("ReduceSum", [halves, self.ints([-2])], f"{name}/Halves/ReduceSum", keepdims=0)
        if q.offsets is None:
            return rows
        table = self.init(f"{prefix}.embedding_offsets", q.offsets)
        off = self.one("Gather", [table, ids], f"{name}/Offsets/Gather")
        off = self.one("Unsqueeze", [off, self.ints([-1])], f"{name}/Offsets/Unsqueeze")
        blocks = self.one("Reshape", [rows, self.ints([0, 0, -1, q.block])], f"{name}/Offsets/Reshape")
        rows = self.one("Add", [blocks, off], f"{name}/Offsets/Add")
        return self.one("Reshape", [rows, self.ints([0, 0, hidden])], f"{name}/Offsets/Flatten")


def rope_tables(hp: Hparams) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[context, head_dim / 2]`` of rotate-half RoPE (positions divided by linear scaling,
    frequencies by ``rope_freqs.weight``'s factors, as llama.cpp applies them)."""
    inv_freq = 1.0 / hp.rope_theta ** (np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim)
    if hp.rope_factors is not None:
        inv_freq = inv_freq / np.asarray(hp.rope_factors, dtype=np.float64)
    angles = np.outer(np.arange(hp.context, dtype=np.float64) / hp.rope_linear, inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def graph_io(hp: Hparams) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    past: list[str | int] = ["batch_size", hp.kv_heads, "past_sequence_length", hp.head_dim]
    present: list[str | int] = ["batch_size", hp.kv_heads, "total_sequence_length", hp.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", i64, ["batch_size", "total_sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch_size", "sequence_length", hp.vocab])]
    for kind in ("key", "value"):
        for i in range(hp.layers):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32, past))
    for kind in ("key", "value"):
        for i in range(hp.layers):
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", f32, present))
    return inputs, outputs


def mask_lengths(w: Writer) -> tuple[str, str]:
    """GroupQueryAttention's ``seqlens_k`` (tokens per row minus one) and ``total_sequence_length``."""
    name = "/model/attn_mask_reformat/attn_mask_subgraph"
    one = w.ints([1])
    total = w.one("ReduceSum", ["attention_mask", one], f"{name}/ReduceSum", keepdims=0)
    lengths = w.one("Sub", [total, one], f"{name}/Sub")
    lengths = w.one("Cast", [lengths], f"{name}/Sub/Cast", to=TensorProto.INT32)
    shape = w.one("Shape", ["attention_mask"], f"{name}/Shape")
    width = w.one("Gather", [shape, w.scalar(1)], f"{name}/Gather", axis=0)
    width = w.one("Cast", [width], f"{name}/Gather/Cast", to=TensorProto.INT32)
    return lengths, width
