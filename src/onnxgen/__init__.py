"""onnxgen: text generation from ONNX exports of decoder LLMs (dense and hybrid) on ONNX Runtime."""

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

__version__ = "0.1.0"

__all__ = [
    "AmbiguousIOError",
    "ConfigError",
    "DecoderIOError",
    "GenerationError",
    "ModelPackageError",
    "OnnxgenError",
    "TokenizerError",
    "UnsupportedModelError",
    "__version__",
]
