"""The OpenAI wire format: validated request models (pydantic) and the response / chunk bodies.

Requests are validated strictly (no string-to-number coercion); unknown fields are ignored, and fields
onnxgen does not implement (``logprobs``, ``echo``, ``best_of`` > 1, ``tools``, ``logit_bias``) are refused
by name rather than silently dropped. Extensions beyond the
OpenAI API: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens`` and
``return_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.responses import JSONResponse

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512  # characters of one stop string
MAX_MESSAGES = 4096  # chat messages of one request (counted before they are validated one by one)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(BaseModel):
    """What both endpoints take: the model, the sampling parameters, streaming and ``n``. ``model`` may be
    left out (one model is served), as vLLM and llama.cpp's server allow; a different name is refused."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # extensions
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    return_token_ids: bool = False  # each choice (or chunk) also carries the generated token ids
    response_format: ResponseFormat | None = None  # json_object / json_schema constrain the output
    # refused when used (see _refuse_unsupported)
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported (got {len(stops)})")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_LENGTH:
            raise ValueError(
                f"a stop string may be at most {MAX_STOP_LENGTH} characters long (got one of {longest}); "
                "stop on a shorter string"
            )
        return stops

    @model_validator(mode="after")
    def _check_lengths(self) -> SamplingFields:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    def refuse_unsupported(self) -> tuple[str, str] | None:
        """(parameter, message) for the first field set to something onnxgen does not implement."""
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported by this server; omit the parameter"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server; omit the parameter"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt list is empty; give a string, a list of strings or token ids")
        return value

    def refuse_unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported by this server; omit it or set it to false"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported by this server (only best_of == n); omit it"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by this server; omit it"
        return super().refuse_unsupported()

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def refuse_unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs:
            return "top_logprobs", "logprobs are not supported by this server; omit the parameter"
        if self.tools:
            return "tools", "tool calling is not supported by this server; omit tools"
        return super().refuse_unsupported()

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ----------------------------------------------------------------------------------------
class ApiError(Exception):
    """An HTTP error answered with an OpenAI-style body (``status`` 4xx for the client's mistakes)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param: str | None = extra.get("param")
        self.code: str | None = extra.get("code")
        self.headers: dict[str, str] | None = extra.get("headers")

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else self.headers
        body = error_body(self.message, self.kind, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=headers)


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the bodies of one request: ``chat`` (chat.completion) or completions (text_completion)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(
        self,
        texts: list[str],
        reasons: list[str | None],
        use: dict[str, int],
        token_ids: list[list[int]] | None = None,
    ) -> dict[str, Any]:
        choices = []
        for index, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
            choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": reason}
            if token_ids is not None:
                choice["token_ids"] = token_ids[index]
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": use}

    def chunk(
        self,
        index: int,
        text: str,
        reason: str | None,
        *,
        first: bool = False,
        use: dict[str, int] | None = None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        body = {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [choice],
        }
        if use is not None:
            body["usage"] = use
        return body

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}
