"""Back a session's weights with transparent huge pages (Linux).

A decode step reads every weight once. With 4 KiB pages a 240 MB fp32 model spans ~60k pages, far more
than the TLB holds, so each step walks page tables for most of its weight reads; with 2 MiB pages it spans
~120. Linux's transparent huge pages give those pages only to memory that asks (``madvise`` mode, the
usual default) or whose mapping happens to be aligned (``always``), and onnxruntime allocates its weights
(and the prepacked copies of them) through plain ``malloc``, which does not ask.

:func:`collapse_new_memory` asks after the fact: given the anonymous mappings that existed before a
session was created, it marks the mappings the session added or grew (the heap among them)
``MADV_HUGEPAGE`` and collapses them into huge pages now (``MADV_COLLAPSE``, Linux 6.1+), skipping
mappings that are mostly unpopulated (collapsing those would make their holes resident). It copies the
memory once (time in proportion to its size), on a background thread (``madvise`` releases the GIL; up to
``SYNC_LIMIT`` bytes could be collapsed before the session is returned, by default none), so a load is not
held up by it and the steps speed up once the collapse is done (:func:`wait`).
The background thread collapses ``CHUNK`` bytes at a time and only while the rest of the process is idle
(:func:`others_busy`): a collapse holds the address space's lock while it copies, so running beside the
first request after a load it stalled that request's allocations and page faults (its first token came
2-4x later). A request that arrives mid-collapse waits for at most one chunk; under load that never
pauses, a chunk goes ahead after ``MAX_DEFER_S``.
Memory the session allocates later (activation arenas) is left alone. :func:`advise` marks a large
buffer before it is first written, so its pages are huge from the start at no copy.

Everything here is advice: where the kernel, the platform or the settings refuse, nothing changes
(measured benefit and costs: README, docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxgen.runtime import memory

log = logging.getLogger(__name__)

HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MIN_POPULATED = 0.75  # share of a mapping that must be resident before it is collapsed
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# bytes collapsed while loading; more is collapsed on a background thread. 0: always in the background, so a
# load returns as soon as onnxruntime's session is ready (a synchronous collapse added ~0.35 s to a 135M int4
# model's 0.3 s load; docs/benchmarks.md) and the pages turn huge in the process's idle moments
SYNC_LIMIT = 0
CHUNK = 8 << 20  # bytes a background collapse copies between checks that the process is idle
IDLE_WINDOW_S = 0.02  # how long the background thread watches the process's CPU time before a chunk
BUSY_SHARE = 0.2  # CPU time of the other threads, as a share of the window, that counts as busy
MAX_DEFER_S = 10.0  # a chunk waits at most this long for an idle moment


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    name: str


def thp_mode() -> str | None:
    """The system's transparent huge page mode (``always``, ``madvise``, ``never``), None off Linux."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


_LOCK = threading.Lock()
_WORKERS: list[threading.Thread] = []  # background collapses not yet joined by wait()


def available() -> bool:
    return memory.MADVISE is not None and thp_mode() in ("always", "madvise")


def anonymous_mappings(smaps: str | None = None, resident: bool = True) -> dict[int, tuple[Mapping, int]]:
    """Private read-write anonymous mappings of this process (the heap included): start -> (mapping,
    resident bytes), read from ``/proc/self/smaps`` (or ``smaps``, its text); with ``resident=False`` from
    ``/proc/self/maps``, far cheaper to read, and every resident count 0."""
    found: dict[int, tuple[Mapping, int]] = {}
    wanted = resident or smaps is not None
    for m in memory.mappings(smaps=wanted, where=lambda path: path in ("", "[heap]"), text=smaps):
        if m.perms.startswith("rw") and m.perms.endswith("p") and m.inode == 0:
            found[m.start] = (Mapping(m.start, m.end, m.path), m.rss)
    return found


def _aligned(start: int, end: int) -> tuple[int, int]:
    return (start + HUGE - 1) // HUGE * HUGE, end // HUGE * HUGE


def collapse_new_memory(before: dict[int, tuple[Mapping, int]]) -> int:
    """Collapse into huge pages the anonymous mappings that are new or grew since ``before`` (an
    :func:`anonymous_mappings` result; a grown one, such as the heap, whole), where mostly resident: now,
    or on a background thread when they span more than ``SYNC_LIMIT`` bytes (then their residency is
    read there too: for gigabytes of heap that read alone takes a tenth of a second). Returns the bytes
    asked to be collapsed, or handed to the background thread (0 where huge pages are unavailable)."""
    if not available():
        return 0
    grown = []  # new or grown since ``before``, from /proc/self/maps (cheap)
    for start, (mapping, _) in anonymous_mappings(resident=False).items():
        old = before.get(start)
        if old is None or old[0].end < mapping.end:
            grown.append(mapping)
    extent = sum(hi - lo for lo, hi in (_aligned(m.start, m.end) for m in grown) if hi > lo)
    if extent > SYNC_LIMIT:
        worker = threading.Thread(
            target=_collapse_populated, args=(grown, True), name="onnxgen-hugepages", daemon=True
        )
        with _LOCK:
            _WORKERS.append(worker)
        worker.start()
        return extent
    return _collapse_populated(grown)


def _collapse_populated(grown: list[Mapping], when_idle: bool = False) -> int:
    """Collapse those of ``grown`` that are mostly resident; the bytes collapsed. ``when_idle``: a chunk at
    a time, each when the rest of the process is idle (the background thread)."""
    try:  # pagemap for these mappings only (smaps would walk every mapping, the weight files' too)
        resident = memory.resident_bytes([memory.Mapping(m.start, m.end, m.name) for m in grown])
    except OSError:
        now = anonymous_mappings()
        resident = [now[m.start][1] if m.start in now else 0 for m in grown]
    ranges = []
    for mapping, count in zip(grown, resident, strict=True):
        if count >= MIN_POPULATED * (mapping.end - mapping.start):
            lo, hi = _aligned(mapping.start, mapping.end)
            if hi - lo >= HUGE:
                ranges.append((lo, hi))
    if when_idle:
        ranges = [(at, min(at + CHUNK, hi)) for lo, hi in ranges for at in range(lo, hi, CHUNK)]
        return _collapse_all(ranges, before_each=IdleGate())
    return _collapse_all(ranges)


def _clocks() -> tuple[float, float, float]:
    return time.monotonic(), time.process_time(), time.thread_time()


def _others_busy(since: tuple[float, float, float]) -> bool:
    """Whether the process's threads other than the calling one (onnxruntime's, the engine's) used more
    than ``BUSY_SHARE`` of a CPU since ``since`` (a :func:`_clocks` reading of the calling thread)."""
    wall, process, own = _clocks()
    others = (process - since[1]) - (own - since[2])
    return others > BUSY_SHARE * (wall - since[0])


def others_busy(window: float = IDLE_WINDOW_S) -> bool:
    """Whether the process's other threads used more than ``BUSY_SHARE`` of a CPU during the next
    ``window`` seconds (the calling thread sleeps meanwhile)."""
    start = _clocks()
    time.sleep(window)
    return _others_busy(start)


class IdleGate:
    """Called before each chunk of a background collapse: returns at once where the rest of the process
    was idle since the previous call (the first call watches it for ``IDLE_WINDOW_S``), else once it has
    been idle for ``IDLE_WINDOW_S`` (or after ``MAX_DEFER_S``)."""

    def __init__(self) -> None:
        self._since: tuple[float, float, float] | None = None

    def __call__(self) -> None:
        if self._since is None:
            self._since = _clocks()
            time.sleep(IDLE_WINDOW_S)
        if _others_busy(self._since):
            deadline = time.monotonic() + MAX_DEFER_S
            while others_busy() and time.monotonic() < deadline:
                pass
        self._since = _clocks()


def wait(timeout: float | None = None) -> bool:
    """Wait for background collapses to finish; False if one is still running after ``timeout``."""
    with _LOCK:
        workers = list(_WORKERS)
    for worker in workers:
        worker.join(timeout)
    with _LOCK:
        _WORKERS[:] = [w for w in _WORKERS if w.is_alive()]
        return not _WORKERS


def _collapse_all(ranges: list[tuple[int, int]], before_each: Callable[[], None] | None = None) -> int:
    """Collapse each huge-page-aligned ``(lo, hi)`` range (calling ``before_each`` first); the bytes
    collapsed."""
    done = 0
    for lo, hi in ranges:
        if before_each is not None:
            before_each()
        done += _collapse(lo, hi)
    log.debug("collapsed %.1f MB of new session memory into huge pages", done / 2**20)
    return done


@contextmanager
def collapsing(enabled: bool = True) -> Iterator[None]:
    """Collapse into huge pages the anonymous memory added while the block runs (a session's creation)."""
    before = anonymous_mappings(resident=False) if enabled and available() else None  # (extents only)
    yield
    if before is not None:
        collapse_new_memory(before)


def _collapse(lo: int, hi: int) -> int:
    if memory.MADVISE is None:
        return 0
    memory.MADVISE(lo, hi - lo, MADV_HUGEPAGE)
    return hi - lo if memory.MADVISE(lo, hi - lo, MADV_COLLAPSE) == 0 else 0


def advise(arrays: Iterable[np.ndarray]) -> None:
    """Ask for huge pages under large arrays not yet written (their first writes then fault huge pages)."""
    if memory.MADVISE is None:
        return
    for a in arrays:
        if a.nbytes >= 2 * HUGE:
            lo, hi = _aligned(a.ctypes.data, a.ctypes.data + a.nbytes)
            if hi > lo:
                memory.MADVISE(lo, hi - lo, MADV_HUGEPAGE)
