"""Where a loaded model's memory is, and letting go of weight pages onnxruntime no longer reads (Linux).

onnxruntime maps the weights an export keeps in data files (and those a prepared graph keeps in the cache,
:mod:`onnxgen.runtime.graph_cache`). Loading reads every page of the weights it repacks (``MatMulNBits``,
``MatMul``) into its own heap copy, and the mapped pages it read stay resident, counted in the process's RSS,
though the kernels only read the packed copy from then on (the int4 exports' scales alone are ~60 MB at the
Qwen3.5-0.8B layout). :func:`release_file_pages` tells the kernel those pages are not needed
(``MADV_DONTNEED`` on the file mappings): they leave the process's resident set and stay in the page cache,
and a page that is read again (an embedding row, a small weight) is mapped back on that read. Nothing is
copied and no value changes.

:func:`breakdown` reads ``/proc/self/smaps`` into what ``onnxgen inspect --memory`` reports.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import resource
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
MB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


MADVISE = _madvise()  # libc's madvise (None off Linux); hugepages uses it too


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    path: str  # "" for anonymous memory, "[heap]", "[stack]", ... for the kernel's names
    perms: str = "r--p"
    inode: int = 0
    rss: int = 0  # resident bytes (from smaps; 0 when read from maps)
    written: int = 0  # pages of a private file mapping this process wrote (anonymous copies, from smaps)


_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+) *(.*)$", re.MULTILINE)
_RSS = re.compile(r"^Rss: +(\d+) kB$", re.MULTILINE)
_ANONYMOUS = re.compile(r"^Anonymous: +(\d+) kB$", re.MULTILINE)


def mappings(
    smaps: bool = False, where: Callable[[str], bool] | None = None, text: str | None = None
) -> list[Mapping]:
    """This process's mappings (``/proc/self/maps``, or ``smaps`` with resident bytes; or ``text``, such a
    file's contents), those whose path ``where`` accepts when given; [] off Linux."""
    if text is None:
        try:
            text = Path("/proc/self/smaps" if smaps else "/proc/self/maps").read_text()
        except OSError:
            return []
    heads = list(_HEADER.finditer(text))
    found: list[Mapping] = []
    for i, head in enumerate(heads):
        path = head.group(5).strip()
        if where is not None and not where(path):
            continue
        start, end, perms, inode = (
            int(head.group(1), 16),
            int(head.group(2), 16),
            head.group(3),
            head.group(4),
        )
        if not smaps:
            found.append(Mapping(start, end, path, perms, int(inode)))
            continue
        stop = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        rss, anonymous = _RSS.search(text, head.end(), stop), _ANONYMOUS.search(text, head.end(), stop)
        kib = (int(rss.group(1)) if rss else 0), (int(anonymous.group(1)) if anonymous else 0)
        found.append(Mapping(start, end, path, perms, int(inode), kib[0] * 1024, kib[1] * 1024))
    return found


def _library(path: str) -> bool:
    return path.endswith(".so") or ".so." in path


def _prefixes(folders: Iterable[Path]) -> tuple[str, ...]:
    return tuple(str(Path(f).resolve()).rstrip("/") + "/" for f in folders)


def release_file_pages(folders: Iterable[Path]) -> int:
    """Drop from the resident set the pages of every file mapping under ``folders`` (see the module
    docstring); the bytes advised (0 where unavailable). A mapping holding a page this process wrote (a
    private copy, which dropping would lose) is left alone: ``/proc/self/pagemap`` tells which present
    pages are anonymous (``/proc/self/smaps`` where pagemap cannot be read)."""
    if MADVISE is None:
        return 0
    prefixes = _prefixes(folders)
    candidates = mappings(where=lambda path: path.startswith(prefixes) and not _library(path))
    if not candidates:
        return 0
    try:
        written = _written(candidates)
    except OSError:
        written = {
            (m.start, m.end)
            for m in mappings(smaps=True, where=lambda p: p.startswith(prefixes))
            if m.written
        }
    total = 0
    for m in candidates:
        if (m.start, m.end) not in written and MADVISE(m.start, m.end - m.start, MADV_DONTNEED) == 0:
            total += m.end - m.start
    log.debug("released %.1f MB of mapped weight pages", total / MB)
    return total


def _written(candidates: list[Mapping]) -> set[tuple[int, int]]:
    """The mappings among ``candidates`` with a present anonymous page (bit 63 present, bit 61 file-backed
    clear in ``/proc/self/pagemap``): pages of a private file mapping that this process wrote."""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        data = b"".join(os.pread(fd, (m.end - m.start) // PAGE * 8, m.start // PAGE * 8) for m in candidates)
    finally:
        os.close(fd)
    entries = np.frombuffer(data, dtype=np.uint64)
    flags = ((entries >> np.uint64(63)) & ~(entries >> np.uint64(61)) & np.uint64(1)).astype(np.int64)
    starts = np.cumsum([0] + [(m.end - m.start) // PAGE for m in candidates[:-1]])
    counts = np.add.reduceat(flags, starts) if flags.size else np.zeros(len(candidates), np.int64)
    return {(m.start, m.end) for m, n in zip(candidates, counts, strict=True) if n}


def resident_bytes(candidates: list[Mapping]) -> list[int]:
    """Resident bytes of each of ``candidates`` (present bit of ``/proc/self/pagemap``): what
    ``/proc/self/smaps`` says, for these mappings only (smaps walks every mapping of the process, the
    weight files' included, which at real sizes takes a tenth of a second). Raises OSError where pagemap
    cannot be read."""
    if not candidates:
        return []
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        data = b"".join(os.pread(fd, (m.end - m.start) // PAGE * 8, m.start // PAGE * 8) for m in candidates)
    finally:
        os.close(fd)
    present = (np.frombuffer(data, dtype=np.uint64) >> np.uint64(63)).astype(np.int64)
    starts = np.cumsum([0] + [(m.end - m.start) // PAGE for m in candidates[:-1]])
    counts = np.add.reduceat(present, starts) if present.size else np.zeros(len(candidates), np.int64)
    return [int(n) * PAGE for n in counts]


def rss_bytes() -> int | None:
    """Resident bytes of this process now (``VmRSS``), None where unreadable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The largest resident set this process has had (``ru_maxrss``)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024  # bytes on macOS


@dataclass
class Breakdown:
    """Resident bytes by kind of mapping (``/proc/self/smaps``)."""

    weights: dict[str, tuple[int, int]] = field(default_factory=dict)  # file -> (mapped, resident)
    anonymous: int = 0  # heap and anonymous mappings: onnxruntime's packed weights, arenas, buffers, Python
    libraries: int = 0  # shared libraries' code and data
    other_files: int = 0
    total: int = 0

    @property
    def weights_mapped(self) -> int:
        return sum(size for size, _ in self.weights.values())

    @property
    def weights_resident(self) -> int:
        return sum(rss for _, rss in self.weights.values())


def breakdown(weight_folders: Iterable[Path]) -> Breakdown:
    """This process's resident memory by kind, weight files being the files under ``weight_folders``."""
    prefixes = _prefixes(weight_folders)
    out = Breakdown()
    for m in mappings(smaps=True):
        out.total += m.rss
        if not m.path or (m.path.startswith("[") and m.path != "[vdso]"):
            out.anonymous += m.rss
        elif _library(m.path):
            out.libraries += m.rss
        elif m.path.startswith(prefixes):
            size, rss = out.weights.get(m.path, (0, 0))
            out.weights[m.path] = (size + m.end - m.start, rss + m.rss)
        else:
            out.other_files += m.rss
    return out


def available_bytes() -> int | None:
    """The memory the kernel says is available to new allocations without swapping (``MemAvailable``),
    or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
