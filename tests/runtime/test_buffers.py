"""Host buffers: aligned allocation, and the buffers a session, its states and a batch hold starting on a 64-byte boundary."""

from __future__ import annotations

import gc

import numpy as np
import onnxruntime as ort
import pytest
from runtime_helpers import (
    DENSE_FAMILIES,
    HYBRID_FAMILIES,
    PROMPT,
    ids,
    open_session,
    prefilled,
    teacher_forced,
)

from onnxgen.runtime.batch import BatchState, RowBuffer
from onnxgen.runtime.buffers import ALIGNMENT, HostBuffer, aligned_copy, aligned_empty, aligned_zeros
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import live

FAMILIES = DENSE_FAMILIES + HYBRID_FAMILIES
SHAPES = [(0,), (1,), (3, 5), (1, 16, 0, 128), (2, 7, 33), (1, 6144, 3), (1, 16, 128, 128)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int32, np.uint8])
@pytest.mark.parametrize("shape", SHAPES)
def test_aligned_arrays_start_on_the_boundary_with_the_shape_type_and_values_asked_for(
    shape: tuple[int, ...], dtype: type
) -> None:
    rng = np.random.default_rng(0)
    source = (rng.standard_normal(shape) * 100).astype(dtype)
    for made in (aligned_zeros(shape, dtype), aligned_empty(shape, dtype), aligned_copy(source)):
        assert made.shape == shape and made.dtype == np.dtype(dtype)
        assert made.flags.c_contiguous and made.flags.writeable
        assert made.size == 0 or made.ctypes.data % ALIGNMENT == 0  # an empty array has no data to place
    assert not aligned_zeros(shape, dtype).any()
    np.testing.assert_array_equal(aligned_copy(source), source)
    # an OrtValue over the array views its memory: what a forward writes is in the array
    buf = HostBuffer.zeros(shape, dtype)
    if buf.array.size:
        assert buf.array.ctypes.data % ALIGNMENT == 0
        assert buf.value.data_ptr() == buf.array.ctypes.data


def test_a_copy_of_a_strided_view_is_aligned_and_contiguous() -> None:
    base = np.arange(2 * 9 * 40, dtype=np.float32).reshape(2, 9, 40)
    view = base[:, 2:7, 1:]  # what truncating a growing KV cache copies
    made = aligned_copy(view)
    assert made.flags.c_contiguous and made.ctypes.data % ALIGNMENT == 0
    np.testing.assert_array_equal(made, view)


def reachable(roots: list[object], kinds: tuple[type, ...]) -> list[object]:
    """The objects of ``kinds`` reachable from ``roots`` through onnxgen objects and containers."""
    seen: set[int] = set()
    found: list[object] = []
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(obj)
        mod = type(obj).__module__
        if isinstance(obj, (dict, list, tuple, set, frozenset)) or mod.startswith("onnxgen"):
            todo.extend(r for r in gc.get_referents(obj) if not isinstance(r, (str, bytes, int, float, type)))
    return found


def bound_pointers(roots: list[object]) -> list[tuple[str, int]]:
    """(what, address) of every host buffer and OrtValue on the CPU reachable from ``roots``."""
    out = []
    for obj in reachable(roots, (HostBuffer, RowBuffer, ort.OrtValue)):
        if isinstance(obj, HostBuffer) and obj.array.size:
            out.append((f"HostBuffer{obj.array.shape}", obj.array.ctypes.data))
        elif isinstance(obj, RowBuffer):
            out.append((f"RowBuffer{obj.array.shape}", obj.array.ctypes.data))
        elif obj.device_name() == "cpu" and np.prod(obj.shape()) > 0:
            out.append((f"OrtValue{tuple(obj.shape())}", obj.data_ptr()))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_buffer_a_forward_binds_starts_on_a_64_byte_boundary(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = session.new_state(40)
    teacher_forced(session, state, PROMPT, [40, 7, 300, 41, 2, 99])  # prefill, then steps on a lane
    stale = prefilled(session, 40)  # a fresh state's first forward reads a zero past
    found = bound_pointers([session, state, stale])
    kinds = {what.split("(")[0] for what, _ in found}
    assert {"HostBuffer", "OrtValue"} <= kinds, kinds
    if family in HYBRID_FAMILIES:  # the recurrent states: current, spares and the zero past
        assert len([w for w, _ in found if w.startswith("HostBuffer")]) >= 3 * len(session.io.state_pairs)
    misplaced = [(what, ptr % ALIGNMENT) for what, ptr in found if ptr % ALIGNMENT]
    assert not misplaced


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_a_batch_binds_aligned_rows(family_dirs, family: str) -> None:
    session = open_session(family_dirs[family])
    batch = BatchState(session, max_batch=3, capacity=40)
    for prompt in (PROMPT, PROMPT[:5]):
        batch.admit(prefilled(session, 40, prompt))
    batch.step([7, 9])
    found = bound_pointers([batch])
    assert any(what.startswith("RowBuffer") for what, _ in found)
    assert not [(what, ptr % ALIGNMENT) for what, ptr in found if ptr % ALIGNMENT]


def test_the_check_sees_a_misaligned_buffer() -> None:
    """Negative control: a buffer 16 bytes past a boundary (where numpy puts large arrays) is reported."""
    raw = aligned_zeros((4096 + 16,), np.uint8)
    skewed = HostBuffer.wrap(raw[16:].view(np.float32))
    found = bound_pointers([[skewed]])
    assert sorted((what, ptr % ALIGNMENT) for what, ptr in found) == [
        ("HostBuffer(1024,)", 16),
        ("OrtValue(1024,)", 16),
    ]


@pytest.mark.parametrize("family", ["standard-dense", "genai-dense"])
def test_a_loaded_prefix_is_bound_aligned_and_continues_as_the_prompt_run_in_one_forward(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    """A prefix loaded in pieces (the prefix cache's restore) lands in aligned buffers, a growing cache's
    pieces joined into one, and the next forward gives the logits of the whole prompt run at once."""
    session = sessions[family]
    source = prefilled(session, 40)
    arrays = source.kv_arrays().values()
    kv = [
        np.split(live(a, axis, source.length), [3], axis=axis)
        for a, axis in zip(arrays, source._kv_axes, strict=True)
    ]
    state = session.new_state(40)
    state.load_prefix(len(PROMPT), kv, None)
    got = session.forward(state, ids([40]))[0, -1]
    want = session.forward(session.new_state(40), ids([*PROMPT, 40]))[0, -1]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert not [(what, ptr % ALIGNMENT) for what, ptr in bound_pointers([state]) if ptr % ALIGNMENT]
