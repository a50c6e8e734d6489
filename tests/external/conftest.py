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

from onnxgen.testing.hf import build_hf_checkpoint, export_with_genai_builder, export_with_mobius

_HERE = Path(__file__).parent

# (family, precision) of every tiny export the tier builds.
EXPORTS: tuple[tuple[str, str], ...] = (
    ("qwen3", "fp32"),
    ("qwen3", "int4"),
    ("llama", "fp32"),
    ("qwen3_5", "fp32"),
    ("qwen3_5", "int4"),
)


# More builder exports (fp32 and int4 of each), tested by test_more_exports.py.
MORE_FAMILIES = ("lfm2", "gemma2", "phi3")
# mobius exports: (checkpoint family, --ep, --static-cache).
MOBIUS: tuple[tuple[str, str | None, bool], ...] = (
    ("qwen3_5_text", "cpu", False),  # linear attention as fused-op functions (Scan bodies inside)
    ("qwen3_5_text", "onnx-standard", False),  # the same inlined: plain Scans
    ("qwen3_next", "cpu", False),
    ("qwen2", None, False),
    ("qwen2", None, True),
)


def mobius_id(family: str, ep: str | None, static: bool) -> str:
    return f"{family}-{ep or 'default'}{'-static' if static else ''}"


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
        return self.family in ("qwen3_5", "qwen3_5_text", "qwen3_next", "lfm2")

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

    def mobius(self, family: str, ep: str | None, static: bool) -> TinyExport:
        key = (family, mobius_id(family, ep, static))
        if key not in self._done:
            pytest.importorskip("mobius")
            hf_dir = self.checkpoint(family)
            out = self.root / f"mobius-{key[1]}"
            if not (out / "inference_metadata.yaml").is_file():
                export_with_mobius(hf_dir, out, ep=ep, static_cache=static)
            self._done[key] = TinyExport(family, key[1], hf_dir, out)
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


def hf_greedy(hf_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (EOS ignored) from the checkpoint's own class."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def genai_greedy(onnx_dir: Path, prompt: list[int], new_tokens: int, max_length: int = 0) -> list[int]:
    """onnxruntime-genai's greedy continuation (EOS ignored); ``max_length`` makes its buffers longer
    (a sliding-window export refuses a KV buffer shorter than its window)."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(onnx_dir))
    params = og.GeneratorParams(model)
    total = max(len(prompt) + new_tokens, max_length)
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(prompt) : len(prompt) + new_tokens]
