"""Converted GGUF models kept on disk, keyed by the file's content and the converter's version.

``<cache root>/gguf/<key>/`` holds one model directory per GGUF file and accuracy level (``key``: the
SHA-256 of its bytes, :data:`CONVERTER_VERSION` and the level). A conversion is built in a temporary folder beside it and renamed into
place, so a reader never sees half a directory and two processes converting at once both end with one
complete copy.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from onnxgen.config import cache_home
from onnxgen.convert.package import DEFAULT_ACCURACY_LEVEL, write_model_dir
from onnxgen.errors import GGUFConversionError

CONVERTER_VERSION = 1  # bumped when a conversion of the same file would come out different
DONE = ".complete"  # written last into a finished directory


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_model(
    src: str | Path, cache_root: str | Path | None = None, accuracy_level: int | None = None
) -> Path:
    """The model directory converted from ``src`` (at ``accuracy_level``), converting it first if the cache
    has none."""
    path = Path(src)
    if not path.is_file():
        raise GGUFConversionError(f"GGUF file {str(path)!r} does not exist")
    root = (Path(cache_root) if cache_root is not None else cache_home()) / "gguf"
    level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    key = f"{file_digest(path)[:32]}-v{CONVERTER_VERSION}-a{level}"
    target = root / key
    if (target / DONE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        write_model_dir(path, work, level)
        (work / DONE).write_text(f"{path.name}\n")
        if target.exists() and not (target / DONE).is_file():
            shutil.rmtree(target, ignore_errors=True)  # a directory left by an interrupted older layout
        try:
            work.rename(target)
        except OSError:
            if not (target / DONE).is_file():  # another process won the race with a complete copy, or not
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
