"""``/tokenize`` and ``/detokenize`` in vLLM's request and response shapes.

``POST /tokenize`` takes ``{"prompt": ..., "add_special_tokens": true}`` or a chat
``{"messages": [...], "add_generation_prompt": true, "tools": ..., "chat_template_kwargs": ...}`` and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``); ``POST /detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt"}``.
Both run on the preparation pool, like any request that tokenizes, answer bodies included (rendered to
JSON there, not on the event loop). ``/tokenize`` takes what a completion or chat request takes: a text
whose byte length proves it longer than the context is refused before it is tokenized, one that
tokenizes to the context or more after, and messages and tools are checked as a chat request's are.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from onnxgen.chat.tools import parse_tools
from onnxgen.server.body import parse_body
from onnxgen.server.prepare import (
    RequestPreparer,
    check_prompt,
    client_errors,
    count_messages_and_tools,
    validation_error,
)
from onnxgen.server.protocol import RESERVED_TEMPLATE_KWARGS, ApiError, ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def _validated(preparer: RequestPreparer, body: bytes, kind: type[BaseModel]) -> Any:
    raw = parse_body(body)
    count_messages_and_tools(raw)  # before validating them one by one
    try:
        req = kind.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e) from e
    preparer.check_model(getattr(req, "model", None))
    return req


def tokenize_body(preparer: RequestPreparer, body: bytes) -> dict[str, Any]:
    req: TokenizeRequest = _validated(preparer, body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give either prompt (text) or messages (a chat) to tokenize", param="prompt")
    tokenizer = preparer.tokenizer
    reserved = sorted(set(req.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ApiError(
            400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    with client_errors():
        if req.messages is not None:
            tools = parse_tools(req.tools)  # the chat limits: at most MAX_TOOLS, each a valid function
            text = tokenizer.apply_chat_template(
                [m.as_template_message() for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                tools=tools or None,
                **(req.chat_template_kwargs or {}),
            )
            ids = preparer.encode(text, "the chat prompt", add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = preparer.encode(req.prompt or "", "the prompt", req.add_special_tokens is not False)
        if ids:
            check_prompt(
                ids, 0, preparer.config.max_model_len, "the chat prompt" if req.messages else "the prompt"
            )
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": preparer.config.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.backend.id_to_token(i) for i in ids]
    return out


def detokenize_body(preparer: RequestPreparer, body: bytes) -> dict[str, Any]:
    req: DetokenizeRequest = _validated(preparer, body, DetokenizeRequest)
    vocab = preparer.llm.session.vocab_size
    bad = [i for i in req.tokens if not 0 <= i < vocab]
    if bad:
        raise ApiError(
            400, f"tokens has ids {bad[:5]} outside the model's vocabulary [0, {vocab})", param="tokens"
        )
    return {"prompt": preparer.tokenizer.decode(req.tokens)}
