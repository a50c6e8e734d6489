"""onnxgen: text generation from ONNX exports of decoder LLMs (dense and hybrid) on ONNX Runtime.

Start with :func:`load`, which opens a model directory (or the bundled demo model) and returns an
:class:`LLM`; :class:`SamplingParams` says how a request samples and when it stops (``LLM.generate``,
``LLM.stream``, ``LLM.chat`` and ``LLM.stream_chat`` also take its fields as keywords)::

    import onnxgen

    llm = onnxgen.load()
    print(llm.generate("def fibonacci(n):", max_new_tokens=32, temperature=0).text)

Speculative decoding: :class:`PromptLookup`, :class:`DraftModel`, :class:`MTP`. Every error onnxgen raises
on bad input is an :class:`OnnxgenError`.

The names below are imported on first use, so that ``import onnxgen`` (and the ``onnxgen`` command's
``--help``) does not pay for onnx and onnxruntime until a model is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "ChatInputError": "onnxgen.chat.tools",
    "ToolCall": "onnxgen.chat.tools",
    "AmbiguousIOError": "onnxgen.errors",
    "ConfigError": "onnxgen.errors",
    "DecoderIOError": "onnxgen.errors",
    "GenerationError": "onnxgen.errors",
    "ModelPackageError": "onnxgen.errors",
    "OnnxgenError": "onnxgen.errors",
    "TokenizerError": "onnxgen.errors",
    "UnsupportedModelError": "onnxgen.errors",
    "ConstraintError": "onnxgen.generation.constraints",
    "GenerationResult": "onnxgen.generation.generator",
    "StreamEvent": "onnxgen.generation.generator",
    "TokenLogprob": "onnxgen.generation.logprobs",
    "ReasoningSection": "onnxgen.generation.params",
    "SamplingParams": "onnxgen.generation.params",
    "MTP": "onnxgen.generation.speculative",
    "DraftModel": "onnxgen.generation.speculative",
    "PromptLookup": "onnxgen.generation.speculative",
    "LLM": "onnxgen.llm",
    "ChatResult": "onnxgen.llm",
    "ChatStreamEvent": "onnxgen.llm",
    "load": "onnxgen.llm",
}

__all__ = [
    "LLM",
    "MTP",
    "AmbiguousIOError",
    "ChatInputError",
    "ChatResult",
    "ChatStreamEvent",
    "ConfigError",
    "ConstraintError",
    "DecoderIOError",
    "DraftModel",
    "GenerationError",
    "GenerationResult",
    "ModelPackageError",
    "OnnxgenError",
    "PromptLookup",
    "ReasoningSection",
    "SamplingParams",
    "StreamEvent",
    "TokenLogprob",
    "TokenizerError",
    "ToolCall",
    "UnsupportedModelError",
    "__version__",
    "load",
]

if TYPE_CHECKING:
    from onnxgen.chat.tools import ChatInputError, ToolCall
    from onnxgen.errors import (
        AmbiguousIOError,
        ConfigError,
        DecoderIOError,
        GenerationError,
        ModelPackageError,
        OnnxgenError,
        TokenizerError,
        UnsupportedModelError,
    )
    from onnxgen.generation.constraints import ConstraintError
    from onnxgen.generation.generator import GenerationResult, StreamEvent
    from onnxgen.generation.logprobs import TokenLogprob
    from onnxgen.generation.params import ReasoningSection, SamplingParams
    from onnxgen.generation.speculative import MTP, DraftModel, PromptLookup
    from onnxgen.llm import LLM, ChatResult, ChatStreamEvent, load


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
