"""External parity tier: real onnxruntime-genai model-builder exports of tiny random HF checkpoints.

Everything here is marked ``external`` and skips itself when torch, transformers or onnxruntime-genai
is missing. Checkpoints and exports are built once per session (a few seconds each) into a temporary
directory, or into ``$ONNXGEN_EXTERNAL_CACHE`` when set (reused across sessions; delete it after
changing :mod:`onnxgen.testing.hf`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from onnxgen.testing.hf import build_hf_checkpoint, export_with_genai_builder

_HERE = Path(__file__).parent

# (family, precision) of every tiny export the tier builds.
EXPORTS: tuple[tuple[str, str], ...] = (
    ("qwen3", "fp32"),
    ("qwen3", "int4"),
    ("llama", "fp32"),
    ("qwen3_5", "fp32"),
    ("qwen3_5", "int4"),
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(_HERE):
            item.add_marker(pytest.mark.external)


@dataclass(frozen=True)
class TinyExport:
    family: str
    precision: str
    hf_dir: Path
    onnx_dir: Path

    @property
    def model_path(self) -> Path:
        return self.onnx_dir / "model.onnx"

    @property
    def is_hybrid(self) -> bool:
        return self.family == "qwen3_5"

    @property
    def id(self) -> str:
        return f"{self.family}-{self.precision}"


class TinyExports:
    """Builds each checkpoint and export on first request and keeps it for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple[str, str], TinyExport] = {}

    def checkpoint(self, family: str) -> Path:
        hf_dir = self.root / "hf" / family
        if not (hf_dir / "config.json").is_file():
            build_hf_checkpoint(family, hf_dir, size="tiny", seed=0)  # type: ignore[arg-type]
        return hf_dir

    def get(self, family: str, precision: str) -> TinyExport:
        key = (family, precision)
        if key not in self._done:
            hf_dir = self.checkpoint(family)
            out = self.root / f"{family}-{precision}"
            if not (out / "genai_config.json").is_file():
                export_with_genai_builder(hf_dir, out, precision, cache_dir=self.root / ".builder-cache")  # type: ignore[arg-type]
            self._done[key] = TinyExport(family, precision, hf_dir, out)
        return self._done[key]


@pytest.fixture(scope="session")
def tiny_exports(tmp_path_factory: pytest.TempPathFactory) -> TinyExports:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    cache = os.environ.get("ONNXGEN_EXTERNAL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("genai-exports")
    root.mkdir(parents=True, exist_ok=True)
    return TinyExports(root)


@pytest.fixture(scope="session", params=EXPORTS, ids=[f"{f}-{p}" for f, p in EXPORTS])
def tiny_export(request: pytest.FixtureRequest, tiny_exports: TinyExports) -> TinyExport:
    """Each tiny export in turn (parametrized over :data:`EXPORTS`)."""
    family, precision = request.param
    return tiny_exports.get(family, precision)


@pytest.fixture(scope="session")
def qwen3_fp32(tiny_exports: TinyExports) -> TinyExport:
    return tiny_exports.get("qwen3", "fp32")


@pytest.fixture(scope="session")
def qwen3_int4(tiny_exports: TinyExports) -> TinyExport:
    return tiny_exports.get("qwen3", "int4")


@pytest.fixture(scope="session")
def llama_fp32(tiny_exports: TinyExports) -> TinyExport:
    return tiny_exports.get("llama", "fp32")


@pytest.fixture(scope="session")
def qwen3_5_fp32(tiny_exports: TinyExports) -> TinyExport:
    return tiny_exports.get("qwen3_5", "fp32")


@pytest.fixture(scope="session")
def qwen3_5_int4(tiny_exports: TinyExports) -> TinyExport:
    return tiny_exports.get("qwen3_5", "int4")
