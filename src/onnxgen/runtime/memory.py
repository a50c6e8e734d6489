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
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
MB = 1 << 20


def _madvise():  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    path: str  # "" for anonymous memory, "[heap]", "[stack]", ... for the kernel's names
    perms: str = "r--p"
    rss: int = 0  # resident bytes (from smaps; 0 when read from maps)
    written: int = 0  # pages of a private file mapping this process wrote (anonymous copies, from smaps)


def mappings(smaps: bool = False) -> list[Mapping]:
    """This process's mappings (``/proc/self/maps``, or ``smaps`` with resident bytes); [] off Linux."""
    try:
        text = Path("/proc/self/smaps" if smaps else "/proc/self/maps").read_text()
    except OSError:
        return []
    found: list[Mapping] = []
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            found.append(Mapping(start, end, head[5].strip() if len(head) > 5 else "", head[1]))
        elif smaps and found and head and head[0] in ("Rss:", "Anonymous:"):
            last, value = found[-1], int(head[1]) * 1024
            if head[0] == "Rss:":
                found[-1] = Mapping(last.start, last.end, last.path, last.perms, value, last.written)
            else:
                found[-1] = Mapping(
                    last.start, last.end, last.path, last.perms, last.rss, last.written + value
                )
    return found


def _library(path: str) -> bool:
    return path.endswith(".so") or ".so." in path


def _under(path: str, folders: Iterable[Path]) -> bool:
    return path.startswith("/") and any(Path(path).parent == f or f in Path(path).parents for f in folders)


def release_file_pages(folders: Iterable[Path]) -> int:
    """Drop from the resident set the pages of every file mapping under ``folders`` (see the module
    docstring); the bytes advised (0 where unavailable)."""
    if _MADVISE is None:
        return 0
    folders = [Path(f).resolve() for f in folders]
    total = 0
    for m in mappings(smaps=True):
        if _library(m.path) or m.written or not _under(m.path, folders):
            continue  # a page written in a private mapping would be lost: unchanged mappings only
        if _MADVISE(m.start, m.end - m.start, MADV_DONTNEED) == 0:
            total += m.end - m.start
    log.debug("released %.1f MB of mapped weight pages", total / MB)
    return total


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
    folders = [Path(f).resolve() for f in weight_folders]
    out = Breakdown()
    for m in mappings(smaps=True):
        out.total += m.rss
        if not m.path or (m.path.startswith("[") and m.path != "[vdso]"):
            out.anonymous += m.rss
        elif _library(m.path):
            out.libraries += m.rss
        elif _under(m.path, folders):
            size, rss = out.weights.get(m.path, (0, 0))
            out.weights[m.path] = (size + m.end - m.start, rss + m.rss)
        else:
            out.other_files += m.rss
    return out
