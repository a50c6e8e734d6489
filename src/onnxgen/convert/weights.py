"""GGUF weight matrices as the ONNX graph holds them, with the same numbers.

A projection is either :class:`~onnxgen.convert.blocks.Blocks` (a quantized GGUF type, mapped block for
block) or a float32 array ``[N, K]`` (F32, F16 and BF16 widen to float32 exactly). Rows are output
features, as in GGUF and in ``MatMulNBits``.

The query and key rows of a ``llama`` GGUF are permuted back to the order the checkpoint was trained in
(llama.cpp's convert script interleaves them for its RoPE): the graph then uses the same rotate-half RoPE
for every architecture, as onnxruntime-genai's builder does. A row permutation moves whole rows, so
quantized rows move with their scales unchanged.
"""

from __future__ import annotations

import numpy as np

from onnxgen.convert.blocks import FLOAT, Blocks, blocks_of
from onnxgen.convert.reader import GGUFFile

Matrix = Blocks | np.ndarray


def matrix(f: GGUFFile, name: str) -> Matrix:
    """The 2-D tensor ``name`` as ``[N, K]`` blocks or float32 (4-bit blocks where the file is read with
    ``quantize_float`` and the rows divide into blocks of ``INT4_BLOCK``)."""
    t = f.tensor(name)
    if t.tensor_type in FLOAT:
        w = f.float_tensor(name)
        return quantize_int4(w) if f.quantize_float and w.shape[1] % INT4_BLOCK == 0 else w
    return blocks_of(np.asarray(t.data), t.tensor_type, name)


INT4_BLOCK = 32


def quantize_int4(w: np.ndarray) -> Blocks:
    """``w`` ``[N, K]`` as symmetric 4-bit blocks of ``INT4_BLOCK`` (round to nearest): per block the scale
    is the largest magnitude over -8, so the extreme weight maps to -8 exactly (the form
    onnxruntime's int4 quantizer and GGUF's Q4_0 use)."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // INT4_BLOCK, INT4_BLOCK)
    idx = np.abs(blocks).argmax(axis=-1)[..., None]
    extreme = np.take_along_axis(blocks, idx, axis=-1)[..., 0]
    scales = (extreme / np.float32(-8)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.clip(np.rint(blocks / safe[..., None]) + 8, 0, 15).astype(np.uint8)
    return Blocks(q.reshape(n, k), scales, None, 4, INT4_BLOCK)


def unpermute_rows(heads: int, rows: int) -> np.ndarray:
    """The row order that undoes llama.cpp's query/key permutation of ``heads`` heads over ``rows`` rows."""
    permuted = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(permuted)


def take_rows(m: Matrix, index: np.ndarray) -> Matrix:
    return m.rows(index) if isinstance(m, Blocks) else m[index]


def same_kind(parts: list[Matrix]) -> bool:
    """Whether ``parts`` can be stacked into one projection (one container, or all float)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return True
    if not all(isinstance(p, Blocks) for p in parts):
        return False
    keys = {(p.bits, p.block, p.offsets is None) for p in parts}  # type: ignore[union-attr]
    return len(keys) == 1


def stack(parts: list[Matrix]) -> Matrix:
    if isinstance(parts[0], Blocks):
        return Blocks.stack(parts)  # type: ignore[arg-type]
    return np.concatenate(parts)  # type: ignore[arg-type]


def dequantized(m: Matrix) -> np.ndarray:
    return m.dequantized() if isinstance(m, Blocks) else m
