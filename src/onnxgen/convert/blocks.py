"""GGUF quantized blocks as the integers, scales and offsets ``MatMulNBits`` reads.

Every GGUF block type this module maps computes a weight as ``scale * q + offset`` per sub-block, with an
integer ``q`` and a float ``scale`` and ``offset`` shared by the sub-block (the K-quants fold their two
levels of scales into one float pair per sub-block, exactly as ``gguf``'s dequantizer does). The numbers
are read through ``gguf``'s own dequantizer rather than by re-implementing each bit layout: a block
whose header says "scale 1, offset 0" dequantizes to its integers, one whose integers are all 1 to its
scales, one whose integers are all 0 to its offsets. Only the header fields' byte positions are spelled
out here; a wrong position shows as integers out of their range (checked) or as a failed comparison with
``gguf.quants.dequantize`` in the tests.

:class:`Blocks` holds the result with ``bits`` 4 or 8 per integer and ``block`` 16 or 32 integers per
scale. Types without an offset store ``q`` shifted by ``2**(bits - 1)`` (unsigned); types with one store
``q`` itself and the offset beside it. :meth:`Blocks.kernel_weights` gives the ``MatMulNBits`` inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from onnxgen.errors import GGUFConversionError

_ONE_F16 = np.array([1.0], dtype=np.float16).view(np.uint8)  # the two bytes of float16 1.0


@dataclass(frozen=True)
class Layout:
    """Where one GGUF block type keeps its fields, and how its integers fit a ``MatMulNBits`` container.

    Each field is ``(start, stop, byte)``: the byte range and the value that sets it for the probe."""

    sub: int  # integers per scale (the MatMulNBits block size)
    bits: int  # container width: 4 or 8
    lo: int  # the smallest integer gguf multiplies by the scale (checked)
    hi: int  # the largest
    unit: tuple[tuple[int, int, int], ...]  # header bytes making scale 1 and offset 0 (f16 1.0 if byte < 0)
    ones: tuple[tuple[int, int, int], ...]  # integer bytes making every integer 1 (and the offset 0)
    zeros: tuple[tuple[int, int, int], ...] = ()  # integer bytes making every integer 0 (offset types)


# byte == -1: the float16 1.0 (two bytes); other bytes fill their range
_LAYOUTS: dict[T, Layout] = {
    T.Q4_0: Layout(32, 4, -8, 7, unit=((0, 2, -1),), ones=((2, 18, 0x99),)),
    T.Q4_1: Layout(
        32, 4, 0, 15, unit=((0, 2, -1), (2, 4, 0)), ones=((2, 4, 0), (4, 20, 0x11)), zeros=((4, 20, 0),)
    ),
    T.Q5_0: Layout(32, 8, -16, 15, unit=((0, 2, -1),), ones=((2, 6, 0xFF), (6, 22, 0x11))),
    T.Q5_1: Layout(
        32,
        8,
        0,
        31,
        unit=((0, 2, -1), (2, 4, 0)),
        ones=((2, 4, 0), (4, 8, 0), (8, 24, 0x11)),
        zeros=((4, 24, 0),),
    ),
    T.Q8_0: Layout(32, 8, -128, 127, unit=((0, 2, -1),), ones=((2, 34, 0x01),)),
    # K-quants: 256 integers per block
    T.Q2_K: Layout(
        16,
        4,
        0,
        3,
        unit=((0, 16, 0x01), (80, 82, -1), (82, 84, 0)),
        ones=((16, 80, 0x55), (82, 84, 0)),
        zeros=((16, 80, 0),),
    ),
    T.Q3_K: Layout(
        16,
        4,
        -4,
        3,
        unit=((96, 104, 0x11), (104, 108, 0xAA), (108, 110, -1)),
        ones=((0, 32, 0xFF), (32, 96, 0x55)),
    ),
    T.Q4_K: Layout(
        32,
        4,
        0,
        15,
        unit=((0, 2, -1), (2, 4, 0), (4, 8, 1), (8, 12, 0), (12, 16, 1)),
        ones=((2, 4, 0), (16, 144, 0x11)),
        zeros=((16, 144, 0),),
    ),
    T.Q5_K: Layout(
        32,
        8,
        0,
        31,
        unit=((0, 2, -1), (2, 4, 0), (4, 8, 1), (8, 12, 0), (12, 16, 1)),
        ones=((2, 4, 0), (16, 48, 0), (48, 176, 0x11)),
        zeros=((16, 176, 0),),
    ),
    T.Q6_K: Layout(
        16, 8, -32, 31, unit=((192, 208, 0x01), (208, 210, -1)), ones=((0, 128, 0x11), (128, 192, 0xAA))
    ),
}

QUANTIZED = tuple(_LAYOUTS)
FLOAT = (T.F32, T.F16, T.BF16)


@dataclass
class Blocks:
    """One weight matrix ``[N, K]``: ``w = scales * (ints - 2**(bits - 1))`` per block for symmetric types,
    ``w = scales * ints + offsets`` for types with offsets. ``ints`` holds one unpacked value per weight."""

    ints: np.ndarray  # [N, K] uint8
    scales: np.ndarray  # [N, K / block] float32
    offsets: np.ndarray | None  # [N, K / block] float32
    bits: int
    block: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.ints.shape

    def dequantized(self) -> np.ndarray:
        """The weights in float32, computed as the GGUF dequantizer computes them."""
        n, k = self.shape
        q = self.ints.reshape(n, k // self.block, self.block).astype(np.float32)
        if self.offsets is None:
            w = self.scales[..., None] * (q - np.float32(2 ** (self.bits - 1)))
        else:
            w = self.scales[..., None] * q + self.offsets[..., None]
        return w.reshape(n, k).astype(np.float32)

    def kernel_weights(self, split_bytes: bool = True) -> KernelWeights:
        """The same weights as ``MatMulNBits`` inputs (:class:`KernelWeights`): 4-bit types as they are;
        8-bit ones split in 4-bit halves (``split_bytes``) or kept 8-bit."""
        n, k = self.shape
        nb = k // self.block
        if self.bits == 4 or not split_bytes:
            zp = None if self.offsets is None else np.zeros((n, nb), np.uint8)
            return KernelWeights(self.ints, self.scales, zp, self.offsets, self.block, self.bits, split=False)
        high = (self.ints >> 4).reshape(n, nb, self.block)
        low = (self.ints & 15).reshape(n, nb, self.block)
        zero = 8 if self.offsets is None else 0  # the container's zero point 128 (or 0) over 16
        ints = np.concatenate([high, low], axis=1).reshape(n, 2 * k)
        scales = np.concatenate([self.scales * np.float32(16), self.scales], axis=1)
        zp = np.concatenate([np.full((n, nb), zero, np.uint8), np.zeros((n, nb), np.uint8)], axis=1)
        return KernelWeights(ints, scales, zp, self.offsets, self.block, 4, split=True)

    def rows(self, index: np.ndarray) -> Blocks:
        """The rows ``index`` (a permutation or selection of output features), exactly."""
        off = None if self.offsets is None else self.offsets[index]
        return Blocks(self.ints[index], self.scales[index], off, self.bits, self.block)

    @staticmethod
    def stack(parts: list[Blocks]) -> Blocks:
        """Several matrices with the same container, one under the other (a fused QKV projection)."""
        first = parts[0]
        offsets = None if first.offsets is None else np.concatenate([p.offsets for p in parts])
        return Blocks(
            np.concatenate([p.ints for p in parts]),
            np.concatenate([p.scales for p in parts]),
            offsets,
            first.bits,
            first.block,
        )


@dataclass
class KernelWeights:
    """A :class:`Blocks` matrix as ``MatMulNBits`` inputs with integer zero points, the forms
    onnxruntime's CPU kernels run fast (float zero points take a slow path, ~100x; so do 8-bit weights
    unless activations are int8, accuracy level 4).

    ``w = scales * (ints - zero_points)`` per block of ``block`` over ``K'`` columns, plus ``offsets`` per
    block of the original ``K`` columns where the type has them. A ``split`` matrix came from 8-bit
    integers ``c = 16 * high + low``: its ``K' = 2K`` 4-bit columns hold the high nibbles (scale ``16 * s``,
    zero point ``z / 16``) and then the low ones (scale ``s``, zero point 0), and the projection reads its
    input twice, ``[x, x]``. Every integer and scale is GGUF's; only the summation order differs."""

    ints: np.ndarray  # [N, K'] uint8
    scales: np.ndarray  # [N, K' / block] float32
    zero_points: np.ndarray | None  # [N, K' / block] uint8 (None: the default 2**(bits - 1))
    offsets: np.ndarray | None  # [N, K / block] float32
    block: int
    bits: int  # 4 or 8
    split: bool

    def packed(self) -> np.ndarray:
        """``ints`` as ``MatMulNBits`` B: ``[N, K' / block, block * bits / 8]`` (4 bits: two per byte, low
        nibble first)."""
        n, k = self.ints.shape
        q = self.ints.reshape(n, k // self.block, self.block)
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8) if self.bits == 4 else q

    def packed_zero_points(self) -> np.ndarray | None:
        """``zero_points`` as ``MatMulNBits`` reads them: ``[N, ceil(K' / block * bits / 8)]``."""
        if self.zero_points is None or self.bits == 8:
            return self.zero_points
        zp = self.zero_points
        if zp.shape[1] % 2:
            zp = np.concatenate([zp, np.zeros((zp.shape[0], 1), np.uint8)], axis=1)
        return (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)


def _probe(raw: np.ndarray, qtype: T, fields: tuple[tuple[int, int, int], ...]) -> np.ndarray:
    """``raw`` rows ``[N, row bytes]`` with ``fields`` of every block overwritten, dequantized by gguf:
    ``[N, K]`` (whole rows: gguf dequantizes row by row)."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = raw.copy().reshape(raw.shape[0], -1, size)
    for start, stop, byte in fields:
        blocks[..., start:stop] = np.tile(_ONE_F16, (stop - start) // 2) if byte < 0 else byte
    return dequantize(blocks.reshape(raw.shape), qtype)


def unmapped_type_error(name: str, qtype: T) -> GGUFConversionError:
    return GGUFConversionError(
        f"GGUF tensor {name!r} has type {qtype.name}, which onnxgen does not map to MatMulNBits "
        f"(mapped: {', '.join(t.name for t in QUANTIZED)}, F32, F16, BF16)"
    )


def check_types(tensors: dict[str, T]) -> None:
    """Refuse the first tensor (by name) whose type this module does not map."""
    for name, qtype in tensors.items():
        if qtype not in _LAYOUTS and qtype not in FLOAT:
            raise unmapped_type_error(name, qtype)


ROWS_AT_ONCE = 1 << 12  # rows probed together: bounds the float32 copies gguf's dequantizer makes


def blocks_of(raw: np.ndarray, qtype: T, name: str) -> Blocks:
    """The GGUF tensor ``name`` (its raw bytes ``[N, K / elements * bytes]`` per block) as :class:`Blocks`."""
    layout = _LAYOUTS.get(qtype)
    if layout is None:
        raise unmapped_type_error(name, qtype)
    rows = np.asarray(raw, dtype=np.uint8).reshape(raw.shape[0], -1)
    parts = [
        _rows_of(rows[i : i + ROWS_AT_ONCE], qtype, layout, name) for i in range(0, len(rows), ROWS_AT_ONCE)
    ]
    return parts[0] if len(parts) == 1 else Blocks.stack(parts)


def _rows_of(rows: np.ndarray, qtype: T, layout: Layout, name: str) -> Blocks:
    q = _probe(rows, qtype, layout.unit)
    if q.min() < layout.lo or q.max() > layout.hi or not np.array_equal(q, np.round(q)):
        raise GGUFConversionError(
            f"GGUF tensor {name!r} ({qtype.name}): its integers fall outside the type's range"
        )
    first = slice(None, None, layout.sub)  # the first element of every sub-block
    scales = _probe(rows, qtype, layout.ones)[:, first]
    offsets = _probe(rows, qtype, layout.zeros)[:, first] if layout.zeros else None
    if offsets is None and layout.lo < 0:
        q += 2 ** (layout.bits - 1)  # unsigned: the kernel's default zero point then applies
    return Blocks(q.astype(np.uint8), scales.astype(np.float32), offsets, layout.bits, layout.sub)
