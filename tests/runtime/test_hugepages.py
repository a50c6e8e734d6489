"""Transparent huge pages under session memory: what is collapsed, what is left alone, nothing changes."""

from __future__ import annotations

import mmap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import onnxgen
from onnxgen.config import HUGE_PAGES
from onnxgen.runtime import hugepages, memory
from onnxgen.testing import build_model

SMAPS = """\
55d0a0000000-55d0a4000000 rw-p 00000000 00:00 0                          [heap]
Size:              65536 kB
Rss:               65000 kB
AnonHugePages:         0 kB
7f0000000000-7f0001000000 rw-p 00000000 00:00 0
Size:              16384 kB
Rss:                 128 kB
7f0002000000-7f0003000000 r--p 00000000 fe:00 1234                       /data/model.onnx.data
Size:              16384 kB
Rss:               16384 kB
7f0004000000-7f0005000000 rw-s 00000000 00:01 99                         /dev/zero (deleted)
Size:              16384 kB
Rss:               16384 kB
7ffc00000000-7ffc00100000 rw-p 00000000 00:00 0                          [stack]
Size:               1024 kB
Rss:                  64 kB
"""


def test_only_private_writable_anonymous_mappings_and_the_heap_are_candidates() -> None:
    found = hugepages.anonymous_mappings(SMAPS)
    assert sorted((m.name, resident) for m, resident in found.values()) == [
        ("", 128 * 1024),
        ("[heap]", 65000 * 1024),
    ]


def _huge_kb(start: int, end: int) -> int:
    """AnonHugePages (kB) of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo < end and start < hi
        elif inside and head and head[0] == "AnonHugePages:":
            total += int(head[1])
    return total


def _private_anonymous(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


needs_thp = pytest.mark.skipif(
    not hugepages.available(), reason="no transparent huge pages (madvise/always) here"
)


@needs_thp
def test_new_resident_memory_is_collapsed_and_keeps_its_contents(monkeypatch: pytest.MonkeyPatch) -> None:
    # A grown heap counts whole, and in a long test process it can span more than the load-time limit
    # (glibc serves even 16 MB from the heap once its mmap threshold has risen): collapse here, now.
    monkeypatch.setattr(hugepages, "SYNC_LIMIT", 1 << 62)
    pattern = np.tile(np.arange(251, dtype=np.uint8), (16 << 20) // 251 + 1)[: 16 << 20]
    before = hugepages.anonymous_mappings()
    buf = _private_anonymous(16 << 20)  # a new mapping, as a session's weights would make
    data = np.frombuffer(buf, dtype=np.uint8)
    data[:] = pattern
    address = data.ctypes.data
    assert _huge_kb(address, address + data.size) == 0
    assert hugepages.collapse_new_memory(before) >= 12 << 20
    assert _huge_kb(address, address + data.size) >= 12 << 10
    np.testing.assert_array_equal(data, pattern)
    del data
    buf.close()


@needs_thp
def test_more_than_the_load_time_limit_is_collapsed_on_a_background_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A big model's load is not held up by the copy: it runs on a thread, and wait() joins it."""
    monkeypatch.setattr(hugepages, "SYNC_LIMIT", 4 << 20)
    assert hugepages.wait(timeout=60)  # the collapses of models loaded earlier in this process
    before = hugepages.anonymous_mappings()
    buf = _private_anonymous(16 << 20)
    data = np.frombuffer(buf, dtype=np.uint8)
    data[:] = 7
    address = data.ctypes.data
    assert hugepages.collapse_new_memory(before) >= 12 << 20
    assert [w.name for w in hugepages._WORKERS] == ["onnxgen-hugepages"]  # pruned only by wait()
    assert hugepages.wait(timeout=60)
    assert not hugepages._WORKERS
    assert _huge_kb(address, address + data.size) >= 12 << 10
    assert int(data.min()) == int(data.max()) == 7
    del data
    buf.close()


@needs_thp
def test_mostly_unpopulated_memory_is_not_collapsed() -> None:
    """Collapsing a sparse mapping would make its holes resident: such mappings are skipped."""
    before = hugepages.anonymous_mappings()
    buf = _private_anonymous(16 << 20)
    data = np.frombuffer(buf, dtype=np.uint8)
    data[:: 1 << 20] = 1  # one page in 256
    address = data.ctypes.data
    hugepages.collapse_new_memory(before)
    assert _huge_kb(address, address + data.size) == 0
    del data
    buf.close()


@needs_thp
def test_large_state_buffers_fault_huge_pages_from_their_first_write() -> None:
    # a fresh mapping: np.zeros may reuse heap pages already written once glibc's mmap threshold has grown
    buf = _private_anonymous(8 << 20)
    a = np.frombuffer(buf, dtype=np.uint8)
    hugepages.advise([a])
    a[:] = 1
    assert _huge_kb(a.ctypes.data, a.ctypes.data + a.nbytes) > 0


def test_sessions_with_and_without_huge_pages_compute_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model(tmp_path / "m", "hybrid-genai")
    with_pages = onnxgen.load(model, huge_pages=True)
    monkeypatch.setenv(HUGE_PAGES, "0")
    without = onnxgen.load(model)
    assert with_pages.session._huge_pages
    assert not without.session._huge_pages  # the environment turns the default off
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    got = [llm.session.forward(llm.session.new_state(16), ids) for llm in (with_pages, without)]
    np.testing.assert_array_equal(got[0], got[1])


def test_resident_bytes_from_pagemap_agree_with_smaps() -> None:
    """collapse_new_memory counts residency through pagemap for the new mappings only; smaps is the
    reference it replaces."""
    buf = _private_anonymous(16 << 20)
    data = np.frombuffer(buf, dtype=np.uint8)
    data[: 5 << 20] = 1  # 5 MiB of 16 written
    address = data.ctypes.data
    mine = next(m for m in memory.mappings(smaps=True) if m.start <= address < m.end)
    try:
        counted = memory.resident_bytes([mine])
    except OSError:
        pytest.skip("/proc/self/pagemap cannot be read here")
    # (written pages plus at most one 2 MiB huge page the kernel may have backed the edge with)
    assert counted == [mine.rss] and 5 << 20 <= mine.rss <= 7 << 20
    del data
    buf.close()


def _spin_for(seconds: float, ended: list[float] | None = None) -> threading.Thread:
    """A thread of this process that keeps a CPU busy for ``seconds`` (as onnxruntime's threads do in a
    forward); appends the monotonic time it stopped to ``ended``."""

    def spin() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(2000))
        if ended is not None:
            ended.append(time.monotonic())

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    return thread


def _goes_idle(within: float = 3.0) -> bool:
    """Whether the process's other threads go idle within ``within`` seconds (onnxruntime's pool threads
    of earlier tests' sessions spin a while after a run)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not hugepages.others_busy(0.05):
            return True
    return False


def test_others_busy_sees_another_thread_working_and_not_an_idle_process() -> None:
    assert _goes_idle()
    spinner = _spin_for(0.5)
    try:
        assert hugepages.others_busy(0.05)
    finally:
        spinner.join()
    assert _goes_idle()


def _chunks_beside_a_busy_thread(monkeypatch: pytest.MonkeyPatch, busy_s: float) -> tuple[list[float], float]:
    """Run the background thread's chunked collapse of a resident 8 MB mapping (``_collapse`` recorded,
    not run: no huge pages needed) while another thread is busy for ``busy_s`` seconds: when each 2 MB
    chunk went and when the busy thread stopped (monotonic seconds)."""
    calls: list[float] = []
    monkeypatch.setattr(hugepages, "CHUNK", 2 << 20)
    monkeypatch.setattr(hugepages, "_collapse", lambda lo, hi: calls.append(time.monotonic()) or hi - lo)
    buf = _private_anonymous(8 << 20)
    data = np.frombuffer(buf, dtype=np.uint8)
    data[:] = 1  # resident: a candidate
    start = data.ctypes.data
    ended: list[float] = []
    assert _goes_idle()
    spinner = _spin_for(busy_s, ended)
    time.sleep(0.05)  # the spinner runs before the collapse starts, as a request right after a load
    done = hugepages._collapse_populated([hugepages.Mapping(start, start + data.size, "")], True)
    spinner.join()
    del data
    buf.close()
    assert done >= 6 << 20 and len(calls) >= 3
    return calls, ended[0]


def test_a_background_collapse_waits_until_the_rest_of_the_process_is_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collapse beside a request stalls the request (the copy holds the address space's lock), so no
    chunk goes while another thread of the process works, and all of them go once it stops."""
    calls, stopped = _chunks_beside_a_busy_thread(monkeypatch, busy_s=0.6)
    assert calls[0] >= stopped


def test_without_the_idle_gate_the_chunks_go_beside_the_busy_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the test above: with a gate that never waits, every chunk goes while the
    other thread is busy."""
    monkeypatch.setattr(hugepages, "IdleGate", lambda: lambda: None)
    calls, stopped = _chunks_beside_a_busy_thread(monkeypatch, busy_s=0.6)
    assert calls[-1] < stopped


def test_a_chunk_waits_for_an_idle_moment_no_longer_than_max_defer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load that never pauses, the chunks still go, each after at most ``MAX_DEFER_S``."""
    monkeypatch.setattr(hugepages, "MAX_DEFER_S", 0.1)
    calls, stopped = _chunks_beside_a_busy_thread(monkeypatch, busy_s=3.0)
    assert calls[-1] < stopped - 1.0
