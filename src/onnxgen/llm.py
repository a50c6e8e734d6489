"""LLM: what :func:`onnxgen.load` returns. Ties package, session, tokenizer and generator together."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from onnxgen.errors import GenerationError, TokenizerError
from onnxgen.generation.generator import GenerationResult, Generator, StreamEvent
from onnxgen.generation.params import SamplingParams
from onnxgen.model import ModelPackage
from onnxgen.runtime.session import DecoderSession
from onnxgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]

DEFAULT_MODEL_DIR = Path(__file__).parent / "data" / "default_model"


def default_model_dir() -> Path:
    """The small model bundled with onnxgen (used when no model is given)."""
    return DEFAULT_MODEL_DIR


class LLM:
    """A loaded decoder export, ready to generate."""

    def __init__(
        self, package: ModelPackage, *, threads: int | None = None, providers: Sequence[str] | None = None
    ) -> None:
        self.package = package
        self.io = package.io
        self.session = DecoderSession(
            package.model_path, self.io, threads=threads, providers=providers, graph=package.graph
        )
        self.tokenizer: Tokenizer | None = None
        if package.tokenizer_path is not None:
            self.tokenizer = Tokenizer.from_dir(package.root)
        eos = package.eos_token_ids or (self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.generator = Generator(self.session, self.tokenizer, eos, package.context_length)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.generator.eos_ids

    # -- prompts ----------------------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(
                f"{self.package.root} has no tokenizer.json, so text prompts cannot be encoded; "
                "pass token ids, or put the model's tokenizer.json beside model.onnx"
            )
        return self.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("the prompt is empty; give non-empty text or token ids")
            return self._require_tokenizer().encode(prompt)
        return [int(i) for i in prompt]

    def chat_prompt(self, messages: Messages, **template_kwargs: Any) -> list[int]:
        tok = self._require_tokenizer()
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        return tok.encode(text, add_special_tokens=False)

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationResult:
        return self.generator.generate(self.encode(prompt), params or SamplingParams())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        return self.generator.stream(self.encode(prompt), params or SamplingParams())

    def chat(self, messages: Messages, params: SamplingParams | None = None) -> GenerationResult:
        return self.generator.generate(self.chat_prompt(messages), params or SamplingParams())

    def stream_chat(self, messages: Messages, params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        return self.generator.stream(self.chat_prompt(messages), params or SamplingParams())


def load(
    model: str | Path | None = None, *, threads: int | None = None, providers: Sequence[str] | None = None
) -> LLM:
    """Open a model directory (or the bundled default model when ``model`` is None) and get it ready."""
    package = ModelPackage.open(model if model is not None else default_model_dir())
    return LLM(package, threads=threads, providers=providers)
