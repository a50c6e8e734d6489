"""GGUF blocks read through gguf's dequantizer: the integers, scales and offsets give back gguf's values,
and their 4-bit form (high and low halves for 8-bit types) holds the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from onnxgen.convert import blocks as blocks_module
from onnxgen.convert.blocks import QUANTIZED, Blocks, blocks_of

# float16 fields of each block (d, and dmin / m where the type has them): byte offsets
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def random_rows(qtype: T, n: int = 7, k: int = 512, seed: int = 0) -> np.ndarray:
    """Random blocks (every bit pattern of the integers and sub-scales) with finite float16 scales."""
    rng = np.random.default_rng(seed)
    elements, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // elements, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[:, at : at + 2] = (
            (rng.standard_normal(len(raw)) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    raw[0, F16_FIELDS[qtype][0] : F16_FIELDS[qtype][0] + 2] = 0  # a block with scale 0
    return raw.reshape(n, -1)


def kernel_weights(b: Blocks, split_bytes: bool) -> np.ndarray:
    """``b``'s MatMulNBits form evaluated in float64: ``scales * (ints - zero_points)`` (+ offsets)."""
    q = b.kernel_weights(split_bytes)
    n, width = q.ints.shape
    zp = (
        np.full(q.scales.shape, 2.0 ** (q.bits - 1))
        if q.zero_points is None
        else q.zero_points.astype(np.float64)
    )
    w = (q.ints.reshape(n, -1, q.block) - zp[..., None]) * q.scales[..., None].astype(np.float64)
    w = w.reshape(n, width)
    if q.split:
        w = w[:, : width // 2] + w[:, width // 2 :]
    if q.offsets is not None:
        w = w + np.repeat(q.offsets.astype(np.float64), q.block, axis=1)
    return w


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_blocks_give_back_gguf_values(qtype: T) -> None:
    raw = random_rows(qtype)
    want = dequantize(raw, qtype)
    b = blocks_of(raw, qtype, "w")
    np.testing.assert_array_equal(b.dequantized(), want)
    assert b.bits in (4, 8) and b.block in (16, 32)
    for split in (True, False):
        np.testing.assert_allclose(kernel_weights(b, split), want, rtol=0, atol=1e-6 * np.abs(want).max())
        q = b.kernel_weights(split)
        assert q.packed().dtype == np.uint8 and q.packed().shape[2] == b.block * q.bits // 8
        assert q.bits == (4 if split else b.bits) and q.ints.max() < 2**q.bits


def test_large_tensors_are_read_in_row_chunks_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = random_rows(T.Q4_K, n=10)
    whole = blocks_of(raw, T.Q4_K, "w")
    monkeypatch.setattr(blocks_module, "ROWS_AT_ONCE", 3)
    chunked = blocks_of(raw, T.Q4_K, "w")
    for a, b in (
        (whole.ints, chunked.ints),
        (whole.scales, chunked.scales),
        (whole.offsets, chunked.offsets),
    ):
        np.testing.assert_array_equal(a, b)


def test_rows_move_with_their_scales() -> None:
    raw = random_rows(T.Q6_K)
    order = np.array([3, 0, 6, 1, 5, 2, 4])
    np.testing.assert_array_equal(
        blocks_of(raw, T.Q6_K, "w").rows(order).dequantized(), dequantize(raw, T.Q6_K)[order]
    )
