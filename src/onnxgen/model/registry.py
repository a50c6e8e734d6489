"""The models ``onnxgen pull`` fetched, by short name: ``registry.json`` in onnxgen's models folder.

The folder is ``$ONNXGEN_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/onnxgen/models``, else
``~/.cache/onnxgen/models``. Each entry maps a name to the model directory it was converted or fetched to
and where it came from; a later command given the name runs that directory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from onnxgen.config import cache_home
from onnxgen.errors import ModelPackageError

REGISTRY_FILE = "registry.json"
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


def models_root() -> Path:
    """The folder pulled models are kept in (made when first written)."""
    return cache_home() / "models"


def is_short_name(text: str) -> bool:
    """A name ``onnxgen pull`` may register: lower case letters, digits, ``.``, ``_`` and ``-``."""
    return _NAME.fullmatch(text) is not None


def _read() -> dict[str, Any]:
    path = models_root() / REGISTRY_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelPackageError(
            f"{path} cannot be read ({e}); delete it and pull the models again with `onnxgen pull NAME`"
        ) from e
    return data if isinstance(data, dict) else {}


def registered(name: str) -> Path | None:
    """The model directory pulled under ``name`` (None where nothing was)."""
    entry = _read().get(name)
    path = entry.get("path") if isinstance(entry, dict) else None
    return Path(path) if isinstance(path, str) else None


def register(name: str, path: Path, source: str) -> None:
    """Record that ``name`` is the model at ``path`` (fetched from ``source``), replacing an older entry."""
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    data = _read()
    # absolute, links kept: a model file in a hub snapshot links to a blob whose folder lacks its data
    data[name] = {"path": os.path.abspath(path), "source": source}
    tmp = root / f".{REGISTRY_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(root / REGISTRY_FILE)  # atomic: a reader sees the old registry or the new one
