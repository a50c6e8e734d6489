"""A GGUF file's metadata and tensors, read with ``gguf`` (the GGUF project's own reader).

:class:`GGUFFile` answers metadata by key and tensors by name; :class:`Hparams` is what the graph writer
needs of an architecture, read once and checked: an architecture or a RoPE scaling the converter does not
map is refused here, by name, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from onnxgen.errors import GGUFConversionError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# llama.cpp's convert script permutes the query and key rows of `llama` checkpoints for its interleaved
# RoPE; qwen2 and qwen3 are stored as trained (rotate-half RoPE).
PERMUTED_QK = ("llama",)


class GGUFFile:
    """The metadata and tensors of one GGUF file (tensors are memory-mapped, read on access)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFConversionError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise GGUFConversionError(f"{str(self.path)!r} is not a readable GGUF file: {e}") from e
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}
        # float (F32/F16/BF16) weight matrices quantized to 4-bit blocks as they are read (convert's
        # ``float_weights="int4"``); quantized GGUF types are never re-quantized
        self.quantize_float = False
        self._values: dict[str, Any] = {}  # decoded once: a vocabulary is tens of thousands of strings

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value ``key`` (lists as lists, strings as str), or ``default``."""
        if key not in self._values:
            field = self.reader.fields.get(key)
            if field is None:
                return default
            self._values[key] = field.contents()
        return self._values[key]

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFConversionError(f"GGUF file {self.path.name!r} has no metadata {key!r}")
        return value

    def tensor(self, name: str) -> ReaderTensor:
        found = self.tensors.get(name)
        if found is None:
            raise GGUFConversionError(f"GGUF file {self.path.name!r} has no tensor {name!r}")
        return found

    def float_tensor(self, name: str) -> np.ndarray:
        """A float tensor (norm weights, biases, embeddings) as float32, in its GGUF shape reversed
        (numpy order: ``[rows, columns]``)."""
        t = self.tensor(name)
        if t.tensor_type == GGMLQuantizationType.BF16:
            bits = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raise GGUFConversionError(
                f"GGUF tensor {name!r} has type {t.tensor_type.name}; onnxgen expects a float type there"
            )
        return np.asarray(t.data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


@dataclass(frozen=True)
class Hparams:
    """What the graph needs of a decoder, from ``{arch}.*`` metadata."""

    arch: str
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rope_linear: float  # position scale of linear RoPE scaling (1: none)
    rope_factors: tuple[float, ...] | None  # rope_freqs.weight: each frequency divided by its factor
    eps: float
    context: int
    vocab: int
    tied: bool

    @staticmethod
    def read(f: GGUFFile) -> Hparams:
        arch = f.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFConversionError(
                f"GGUF architecture {arch!r} is not supported by onnxgen convert "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        hidden = int(f.require(f"{arch}.embedding_length"))
        heads = int(f.require(f"{arch}.attention.head_count"))
        head_dim = int(f.get(f"{arch}.attention.key_length", hidden // heads))
        scaling = f.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise GGUFConversionError(
                f"GGUF RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported by onnxgen convert "
                "(supported: none, linear)"
            )
        rope_dim = int(f.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise GGUFConversionError(
                f"GGUF {arch}.rope.dimension_count {rope_dim} differs from the head size {head_dim} (partial "
                "RoPE), which onnxgen convert does not map"
            )
        vocab = f.get(f"{arch}.vocab_size") or len(f.require("tokenizer.ggml.tokens"))
        return Hparams(
            arch=arch,
            name=str(f.get("general.name", f.path.stem)),
            layers=int(f.require(f"{arch}.block_count")),
            hidden=hidden,
            intermediate=int(f.require(f"{arch}.feed_forward_length")),
            heads=heads,
            kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_linear=float(f.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
            rope_factors=_rope_factors(f, head_dim),
            eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
            context=int(f.get(f"{arch}.context_length", 4096)),
            vocab=int(vocab),
            tied="output.weight" not in f.tensors,
        )


def _rope_factors(f: GGUFFile, head_dim: int) -> tuple[float, ...] | None:
    """``rope_freqs.weight`` (Llama 3.1-style scaling as llama.cpp stores it: one divisor per frequency)."""
    if "rope_freqs.weight" not in f.tensors:
        return None
    factors = f.float_tensor("rope_freqs.weight").reshape(-1)
    if factors.size != head_dim // 2:
        raise GGUFConversionError(
            f"GGUF tensor 'rope_freqs.weight' has {factors.size} factors; the head size {head_dim} needs "
            f"{head_dim // 2}"
        )
    return tuple(float(x) for x in factors)
