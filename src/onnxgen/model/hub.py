"""Hugging Face hub repositories as models: a repository id resolved from the local hub cache, and fetched.

The hub cache is where ``huggingface_hub`` keeps it: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``, read when a call is made (not when
``huggingface_hub`` was imported). ``$HF_HUB_OFFLINE`` keeps :func:`download_repo` to what the cache holds.
``huggingface_hub`` is imported only here, inside the functions that use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType

from onnxgen.errors import ModelPackageError

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# what an ONNX repository needs of its files: the root's configs and tokenizer, the decoder at the root or
# in onnx/ (with its external data), never the other variants (fp16, q4, ...) beside it
ONNX_REPO_FILES = (
    "*.json",
    "*.jinja",
    "*.yaml",
    "*.txt",
    "tokenizer.*",
    "model.onnx",
    "model.onnx.data",
    "model.onnx_data*",
    "onnx/model.onnx",
    "onnx/model.onnx.data",
    "onnx/model.onnx_data*",
    "mtp.onnx*",
)
_TRUE = ("1", "true", "yes", "on")


def is_repo_id(text: str) -> bool:
    """``ORG/REPO`` as the hub spells repository ids (a path that exists is never one)."""
    return _REPO_ID.fullmatch(text) is not None and ".." not in text and not Path(text).exists()


def hub_cache_dir() -> Path:
    """The hub cache ``huggingface_hub`` uses, from the environment as it is now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``$HF_HUB_OFFLINE`` (or ``$TRANSFORMERS_OFFLINE``) forbids the network."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def _hub() -> ModuleType:
    try:
        import huggingface_hub
    except ImportError as e:  # a core dependency; an install without it still gets one line
        raise ModelPackageError(
            f"Hugging Face hub ids need huggingface_hub ({e}); pip install huggingface_hub"
        ) from e
    return huggingface_hub


def cached_repo(repo_id: str) -> Path:
    """The newest snapshot of ``repo_id`` in the local hub cache (no network)."""
    hub = _hub()
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hub.snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True))
    except LocalEntryNotFoundError as e:
        raise ModelPackageError(
            f"{repo_id} is not a local path and not in the Hugging Face cache ({hub_cache_dir()}); fetch "
            f"it with `onnxgen pull {repo_id}` (a GGUF repository: `onnxgen pull {repo_id} --file NAME.gguf`)"
        ) from e


def download_repo(repo_id: str, file: str | None = None) -> Path:
    """Fetch ``repo_id`` into the hub cache and return its snapshot folder: with ``file``, that file (and
    an ONNX file's external data); else the files of an ONNX model (:data:`ONNX_REPO_FILES`). Offline
    (``$HF_HUB_OFFLINE``), only what the cache holds."""
    hub = _hub()
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = (
        [file, f"{file}.data", f"{file}_data*", *ONNX_REPO_FILES[:5]] if file else list(ONNX_REPO_FILES)
    )
    try:
        folder = hub.snapshot_download(
            repo_id,
            cache_dir=hub_cache_dir(),
            allow_patterns=patterns,
            local_files_only=hub_offline(),
        )
    except LocalEntryNotFoundError as e:
        why = "$HF_HUB_OFFLINE is set and " if hub_offline() else ""
        raise ModelPackageError(
            f"{why}{repo_id} is not in the Hugging Face cache ({hub_cache_dir()}) and could not be fetched "
            f"({e}); check the id and the network, or unset HF_HUB_OFFLINE"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise ModelPackageError(f"{repo_id} could not be fetched from the Hugging Face hub ({e})") from e
    path = Path(folder)
    if file and not (path / file).is_file():
        raise ModelPackageError(f"{repo_id} has no file {file}; name one of its files with --file")
    return path
