"""Host buffers that onnxruntime reads and writes in place.

On the CPU an ``OrtValue`` made by ``ortvalue_from_numpy`` shares memory with its numpy array, so
onnxgen keeps every KV and state buffer as a (numpy array, OrtValue) pair: the runtime binds the OrtValue,
the state object reads, zeroes, snapshots and rewinds through the array, and nothing is copied per step.

The buffers onnxgen keeps for forwards to bind (KV caches, recurrent states and their spares, logits,
input buffers and masks, a batch's rows) start on a 64-byte boundary (:func:`aligned_zeros`), as
onnxruntime's own allocations do; a batched step's small per-step index arrays and arrays a caller passes
in are bound where numpy put them. numpy places a large array 16 bytes past one, and kernels that stream a bound buffer with
64-byte vector loads pay for the split cache lines: onnxruntime's ``LinearAttention`` runs 1.2x slower
on a misaligned recurrent state for one token and 1.5x slower for a 512-token prompt (AVX-512;
docs/benchmarks.md, "Aligned buffers, and the int4 cells on an AVX-512 machine").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from onnxgen.model.io import DecoderIO
from onnxgen.runtime.hugepages import advise

ALIGNMENT = 64  # bytes: a cache line, one AVX-512 vector; onnxruntime's CPU allocator aligns to this

_NP_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.float32,  # not representable in numpy: refused by dtype_of()
    "int64": np.int64,
    "int32": np.int32,
}


def dtype_of(name: str) -> np.dtype:
    """numpy dtype for a DecoderIO dtype name."""
    if name not in _NP_DTYPES or name == "bfloat16":
        from onnxgen.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"tensor element type {name!r} is not supported for KV/state buffers; "
            "export the model with float32 or float16 caches"
        )
    return np.dtype(_NP_DTYPES[name])


def index_dtype(io: DecoderIO, name: str | None) -> type:
    """The numpy type to feed graph input ``name`` in: int32 where the graph declares int32, else int64
    (also for ``None``, an input the graph does not have). Derivation refuses any other type."""
    if name is None:
        return np.int64
    return np.int32 if io.port(name).dtype == "int32" else np.int64


@dataclass(frozen=True)
class IndexDtypes:
    """The numpy types of the integer inputs onnxgen writes: token ids, attention mask, position ids and a
    static cache's write indices and lengths (None without a static cache), as the graph declares them."""

    token: type
    mask: type
    position: type
    static: tuple[type, type] | None

    @classmethod
    def of(cls, io: DecoderIO) -> IndexDtypes:
        static = io.static_cache
        return cls(
            index_dtype(io, io.token_input),
            index_dtype(io, io.attention_mask),
            index_dtype(io, io.position_ids),
            (index_dtype(io, static.write_indices), index_dtype(io, static.kv_lengths)) if static else None,
        )


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an :data:`ALIGNMENT`-byte boundary."""
    return _aligned(shape, dtype, np.empty)


def aligned_zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """:func:`aligned_empty`, zeroed (large ones lazily: fresh pages from the OS, as ``np.zeros``)."""
    return _aligned(shape, dtype, np.zeros)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous aligned copy of ``array``."""
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def _aligned(shape: tuple[int, ...], dtype: np.dtype | type, make) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = make(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


@dataclass
class HostBuffer:
    """A numpy array and the OrtValue that views the same memory."""

    array: np.ndarray
    value: ort.OrtValue

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: np.dtype) -> HostBuffer:
        array = aligned_zeros(shape, dtype)
        advise((array,))  # large buffers (KV caches): huge pages from their first write
        return cls.wrap(array)

    @classmethod
    def wrap(cls, array: np.ndarray) -> HostBuffer:
        array = np.ascontiguousarray(array)
        return cls(array, ort.OrtValue.ortvalue_from_numpy(array))
