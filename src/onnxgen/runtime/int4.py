"""Blockwise int4 quantization by onnxruntime's own kernel: what its ``MatMulNBitsQuantizer`` (and so
onnxruntime-genai's builder) runs, called directly because that module's import pulls in sympy."""

from __future__ import annotations

import numpy as np

from onnxgen.graph.int4_lm_head import BLOCK_SIZE
from onnxgen.runtime.binding import OrtInternals


def quantize_int4(w: np.ndarray, block_size: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric blockwise int4 of ``w`` ``[K, N]``: packed ``[N, blocks, block_size / 2]`` uint8 and
    scales ``[N, blocks]`` (MatMulNBits' layout; K is zero-padded to whole blocks)."""
    k, n = w.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), dtype=np.float32)
    padded[:k] = w
    packed = np.zeros((n, blocks, block_size // 2), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    zero_points = np.zeros((n, (blocks + 1) // 2), dtype=np.uint8)
    OrtInternals.quantize_matmul_4bits()(
        packed, padded, scales, zero_points, block_size, n, blocks * block_size, True
    )
    return packed, scales


__all__ = ["quantize_int4"]
