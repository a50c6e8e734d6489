"""Blockwise int4 weight quantization in the layout of ``com.microsoft::MatMulNBits`` (bits=4).

A float weight ``W`` [K, N] (``x @ W`` convention) is quantized per output column in blocks of
``block_size`` consecutive input features. Symmetric: no zero points are stored, so the op's default zero
point 8 applies and ``W ≈ (q - 8) * scale`` with ``q`` in [0, 15]; ``scale`` may be negative.

Layout (what the op reads): ``B`` uint8 [N, K/block, block/2], element ``2j`` of a block in the low nibble
of byte ``j`` and element ``2j+1`` in the high nibble; ``scales`` float32 [N * K/block] (column-major by
block: all blocks of column 0 first). K that is not a multiple of the block is zero-padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_SIZE = 32
BITS = 4
_ZERO_POINT = 8


@dataclass(frozen=True)
class Int4Weight:
    """One quantized weight: the packed nibbles, the scales and the logical shape [K, N]."""

    packed: np.ndarray  # uint8 [N, blocks, block_size // 2]
    scales: np.ndarray  # float32 [N * blocks]
    k: int
    n: int
    block_size: int = BLOCK_SIZE

    @property
    def blocks(self) -> int:
        return self.packed.shape[1]


def quantize_int4(w: np.ndarray, block_size: int = BLOCK_SIZE) -> Int4Weight:
    """Quantize ``w`` [K, N] float32 to symmetric blockwise int4."""
    if w.ndim != 2:
        raise ValueError(f"quantize_int4 expects a 2-D weight [K, N], got shape {w.shape}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    k, n = w.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), dtype=np.float32)
    padded[:k] = w
    cols = padded.T.reshape(n, blocks, block_size)  # [N, blocks, block]
    # The entry of largest magnitude maps to -8 exactly (all 16 levels used), as onnxruntime's quantizer does.
    pick = np.take_along_axis(cols, np.abs(cols).argmax(axis=2)[..., None], axis=2)
    scale = np.where(pick != 0, pick / -8.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(cols / scale), -8, 7).astype(np.int32) + _ZERO_POINT
    q = q.astype(np.uint8)
    packed = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8)
    return Int4Weight(packed=packed, scales=scale.reshape(-1), k=k, n=n, block_size=block_size)


def dequantize_int4(qw: Int4Weight) -> np.ndarray:
    """The float32 [K, N] weight that ``qw`` stands for (what MatMulNBits multiplies by)."""
    low = (qw.packed & 0x0F).astype(np.int32)
    high = (qw.packed >> 4).astype(np.int32)
    q = np.empty((qw.n, qw.blocks, qw.block_size), dtype=np.int32)
    q[:, :, 0::2] = low
    q[:, :, 1::2] = high
    scales = qw.scales.reshape(qw.n, qw.blocks, 1)
    cols = ((q - _ZERO_POINT).astype(np.float32) * scales).reshape(qw.n, -1)
    return np.ascontiguousarray(cols[:, : qw.k].T)
