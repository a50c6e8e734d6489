"""Where a user's model argument becomes a model directory: the one place every command and
:func:`onnxgen.load` send it through.

In order: a path that exists (a model directory, also in the ``onnx/model.onnx`` layout; a ``.onnx``
file; a ``.gguf`` file, converted once into a cache; a folder holding one GGUF file), a name given to
``onnxgen pull``, a Hugging Face hub id found in the local hub cache. A checkpoint folder, a config file
and a name nothing knows are each answered with one line saying what to do instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from onnxgen.errors import ModelPackageError
from onnxgen.model.catalog import CATALOG
from onnxgen.model.checkpoint import NOT_MODEL_SUFFIXES, checkpoint_error, not_a_model
from onnxgen.model.hub import cached_repo, is_repo_id
from onnxgen.model.registry import registered

GGUF_MAGIC = b"GGUF"
_ONNX_MARKERS = ("manifest.json", "nxrt_info.json", "genai_config.json", "inference_metadata.yaml")


def resolve_model(arg: str | os.PathLike[str]) -> Path:
    """The model directory (or ``.onnx`` file) that ``arg`` names; see the module's docstring for the
    order. Raises :class:`~onnxgen.errors.ModelPackageError` with what to do where it names none."""
    text = os.fspath(arg)
    path = Path(text).expanduser()
    if path.exists():
        return _local(path)
    pulled = registered(text)
    if pulled is not None:
        if not pulled.exists():
            raise ModelPackageError(
                f"{text} was pulled to {pulled}, which is gone; fetch it again with `onnxgen pull {text}`"
            )
        return pulled
    if text in CATALOG:
        raise ModelPackageError(f"{text} has not been pulled yet; fetch it with `onnxgen pull {text}`")
    if is_repo_id(text):
        return folder_model(cached_repo(text), f"{text} (Hugging Face cache)")
    raise ModelPackageError(
        f"model {text} does not exist; pass a model directory (holding model.onnx), a .onnx or .gguf file, "
        f"a name from `onnxgen pull` ({', '.join(CATALOG)}) or a Hugging Face hub id ORG/REPO"
    )


def _local(path: Path) -> Path:
    if path.is_dir():
        return folder_model(path, str(path), strict=False)
    if is_gguf(path):
        return gguf_model(path)
    if path.suffix.lower() in NOT_MODEL_SUFFIXES:
        raise not_a_model(path)
    return path


def folder_model(folder: Path, label: str, *, strict: bool = True) -> Path:
    """The model in ``folder``: the folder itself where it holds an ONNX model (at its root or in
    ``onnx/``); its GGUF file, converted, where it holds one and no ONNX model. A checkpoint folder is an
    error that gives the export command. ``strict``: a folder with neither is an error (else it is
    returned, and :meth:`ModelPackage.open` says what it misses)."""
    onnx_files = [*folder.glob("*.onnx"), *folder.glob("onnx/*.onnx")]
    if onnx_files or any((folder / marker).is_file() for marker in _ONNX_MARKERS):
        return folder
    checkpoint = checkpoint_error(folder)
    if checkpoint is not None:
        raise checkpoint
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_model(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelPackageError(f"{label} holds several GGUF files ({names}); pass the one to run")
    if strict:
        raise ModelPackageError(
            f"{label} holds no ONNX model (model.onnx or onnx/model.onnx) and no GGUF file"
        )
    return folder


def is_gguf(path: Path) -> bool:
    """A ``.gguf`` file, or any file that starts with the GGUF magic."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def gguf_model(path: Path) -> Path:
    """The model directory of the GGUF file at ``path``, converted on first use into onnxgen's cache."""
    try:
        from onnxgen.convert import cached_gguf_model
    except ImportError as e:
        raise ModelPackageError(f"{path} is a GGUF file, and this onnxgen cannot convert GGUF ({e})") from e
    return cached_gguf_model(path)
