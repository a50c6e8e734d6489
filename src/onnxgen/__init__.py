"""onnxgen: text generation from ONNX exports of decoder LLMs (dense and hybrid) on ONNX Runtime."""

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
