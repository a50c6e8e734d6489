"""A Hugging Face hub cache laid out as ``huggingface_hub`` writes it, made from local files for tests.

``models--ORG--REPO/blobs/<sha256>`` holds each file once, ``snapshots/<commit>/<path>`` links to it (as
the hub client does on Linux) and ``refs/main`` names the commit, so ``snapshot_download(...,
local_files_only=True)`` finds the snapshot with no network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """Put ``files`` (path in the repository -> local file) into ``cache`` as ``repo_id``'s ``main``
    snapshot; return the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def repo_files(model_dir: Path, onnx_folder: bool = False) -> dict[str, Path]:
    """A model directory's files as a hub repository holds them: with ``onnx_folder``, the ``.onnx``
    model and its data under ``onnx/`` and the rest at the root (the ONNX model repositories' layout)."""
    out = {}
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            model_file = path.name.startswith("model.onnx")
            out[f"onnx/{path.name}" if onnx_folder and model_file else path.name] = path
    return out
