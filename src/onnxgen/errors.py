"""One error hierarchy for onnxgen.

Every message names what is wrong (the file, port or parameter) and how to fix it. User errors are
caught by the CLI and printed as one line, never as a traceback.
"""

from __future__ import annotations


class OnnxgenError(Exception):
    """Base class of every error onnxgen raises on purpose."""


class ModelPackageError(OnnxgenError):
    """A model directory is missing a file, or a file in it cannot be read."""


class ConfigError(ModelPackageError):
    """A config file beside the model (genai_config.json, inference_metadata.yaml, ...) is malformed."""


class DecoderIOError(OnnxgenError):
    """The decoder's I/O topology cannot be derived or does not match what was declared."""


class AmbiguousIOError(DecoderIOError):
    """Two or more ports fit one role; the message names the candidates and how to declare the role."""


class UnsupportedModelError(OnnxgenError):
    """The export uses something onnxgen cannot run (an op, a dtype, a layout)."""


class GenerationError(OnnxgenError):
    """A request cannot be served as given (prompt too long, unknown token ids, empty prompt, ...)."""


class TokenizerError(OnnxgenError):
    """The tokenizer or chat template is missing or cannot be used."""


class SettingError(OnnxgenError, ValueError):
    """An onnxgen environment variable holds a value onnxgen does not understand."""


class GGUFConversionError(UnsupportedModelError):
    """A GGUF file cannot be converted: an architecture, tensor type or setting the converter does not map."""
