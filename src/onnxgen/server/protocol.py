"""The OpenAI wire format: validated request models (pydantic), errors and usage.

Requests are validated strictly (no string-to-number coercion); unknown fields are ignored, and fields
onnxgen does not implement (``echo``, ``best_of`` > 1, ``suffix``) are refused by name
rather than silently dropped. Extensions beyond the OpenAI API (as vLLM names them): ``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``return_token_ids``, ``logprobs_mode``, ``json_extra_properties``, ``cache_salt``, and on chat
``chat_template_kwargs``.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.responses import JSONResponse

from onnxgen.generation.params import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512  # characters of one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 4096  # chat messages of one request (counted before they are validated one by one)
MAX_DRAFT_TOKENS = 16  # the speculative extension's num_draft_tokens (a verify then runs up to 3x + 1)
SPECULATIVE_METHODS = ("prompt-lookup", "mtp", "mtp-always", "draft", "off")
# template variables a request may not set through chat_template_kwargs (the server sets them)
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "documents")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SpeculativeField(BaseModel):
    """The ``speculative`` extension: how one request drafts tokens, overriding ``--speculative``.

    ``method``: ``prompt-lookup`` (n-grams of the context), ``mtp`` / ``mtp-always`` (the model's MTP
    head), ``draft`` (the draft model the server was started with) or ``off``; ``num_draft_tokens``: the
    first verify's drafts (default 4, 2 for MTP); ``adaptive``: the length then adapts up to 3x, following
    acceptance and measured times (False: fixed, so seeded sampling draws alike on every run)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    method: Literal["prompt-lookup", "mtp", "mtp-always", "draft", "off"]
    num_draft_tokens: int | None = Field(default=None, ge=1, le=MAX_DRAFT_TOKENS)
    adaptive: bool = True


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
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    return_token_ids: bool = False  # each choice (or chunk) also carries the generated token ids
    logprobs_mode: Literal["raw", "processed"] = "raw"  # which distribution logprobs come from
    response_format: ResponseFormat | None = None  # json_object / json_schema constrain the output
    speculative: SpeculativeField | None = None  # None: the server's --speculative (if any)
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    # JSON Schema's reading of response_format and tool schemas: unlisted keys allowed where an object
    # says nothing of additionalProperties (default: OpenAI's, only the listed ones)
    json_extra_properties: bool = False
    # the prefix-cache partition (vLLM's): prefixes are shared only among requests with the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

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
        return None

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token in ``logprobs``; None when no logprobs are asked for (each endpoint
        names the count its own way)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy form: a count

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

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token in ``logprobs``; None when no logprobs are asked for."""
        return self.logprobs

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return p  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    """A call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking (also accepted as ``reasoning``)
    reasoning: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            message["reasoning_content"] = thinking
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # checked by onnxgen.chat.tools.parse_tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        reserved = sorted(set(self.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them); "
                "pass messages and tools as request fields"
            )
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- errors and usage ----------------------------------------------------------------------------------------
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` (prompt tokens resumed from the prefix cache, where the
    server has one) goes into ``prompt_tokens_details`` as OpenAI reports it."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out
