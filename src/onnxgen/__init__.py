"""onnxgen: text generation from ONNX exports of decoder LLMs (dense and hybrid) on ONNX Runtime."""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from onnxgen.chat.tools import ChatInputError, ToolCall
    from onnxgen.generation.constraints import ConstraintError
    from onnxgen.generation.generator import GenerationResult, StreamEvent
    from onnxgen.generation.logprobs import TokenLogprob
    from onnxgen.generation.params import ReasoningSection, SamplingParams
    from onnxgen.generation.speculative import MTP, DraftModel, PromptLookup
    from onnxgen.llm import LLM, ChatResult, ChatStreamEvent, load

# The engine's names are imported on first use, so that ``import onnxgen.errors`` (or a tool that needs
# one small module, such as the benchmark's onnxruntime-genai worker) does not load onnx and onnxruntime.
_LAZY = {
    "ChatInputError": "onnxgen.chat.tools",
    "ToolCall": "onnxgen.chat.tools",
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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxgen' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

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
