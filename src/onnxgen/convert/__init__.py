"""GGUF files as onnxgen model directories, weights mapped exactly (no re-quantization).

:func:`convert_gguf` writes a model directory from a GGUF file; :func:`cached_gguf_model` converts once
into a cache keyed by the file's content and returns the cached directory afterwards. docs/gguf.md lists
the architectures and tensor types mapped; anything else raises
:class:`~onnxgen.errors.GGUFConversionError` naming it.
"""

from __future__ import annotations

from pathlib import Path

from onnxgen.convert.cache import cached_model
from onnxgen.convert.package import write_model_dir
from onnxgen.errors import GGUFConversionError

__all__ = ["GGUFConversionError", "cached_gguf_model", "convert_gguf"]


def convert_gguf(
    src: str | Path, out_dir: str | Path, *, accuracy_level: int | None = None, float_weights: str = "keep"
) -> Path:
    """Write the model directory of GGUF file ``src`` into ``out_dir`` and return it.

    ``accuracy_level`` is MatMulNBits': None or 1 computes with float32 activations (the GGUF's weights,
    exactly); 4 quantizes activations to int8 per block, as llama.cpp does for these types (faster).
    ``float_weights``: ``"keep"`` F32/F16/BF16 weight matrices as they are, or ``"int4"``: quantize them to
    symmetric 4-bit blocks of 32 (the file's quantized types are never re-quantized).
    Refusals come before anything is written; a conversion that fails later may leave ``out_dir`` partly
    written (:func:`cached_gguf_model` never does)."""
    return write_model_dir(src, out_dir, accuracy_level, float_weights)


def cached_gguf_model(
    src: str | Path, cache_root: str | Path | None = None, *, accuracy_level: int | None = None
) -> Path:
    """The converted model directory of GGUF file ``src``, from ``cache_root`` (None: onnxgen's cache
    folder, ``$ONNXGEN_CACHE_DIR`` or the user cache directory) or converted into it first (atomically;
    one entry per file content and accuracy level)."""
    return cached_model(src, cache_root, accuracy_level)
