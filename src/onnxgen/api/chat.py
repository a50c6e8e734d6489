"""Chat Completions (and Completions) bodies for parsed replies and token log-probabilities.

A reply's thinking goes out as ``reasoning_content`` and under its newer name ``reasoning``; tool calls
as ``tool_calls`` (streamed: the first piece of a call has its ``id``, ``type`` and name, later pieces
pieces of ``arguments``). Log-probabilities follow OpenAI's shapes; ``-inf`` (a token the constraint or
top-k masked, in ``"processed"`` mode) is written as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from onnxgen.chat.deltas import ChatDelta
from onnxgen.chat.output import ChatOutput
from onnxgen.generation.logprobs import TokenLogprob

NEG_INF_LOGPROB = -9999.0
TokenBytes = Callable[[int], bytes]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


def _token(token_id: int, logprob: float, token_bytes: TokenBytes) -> dict[str, Any]:
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}


def openai_logprob(score: TokenLogprob, token_bytes: TokenBytes) -> dict[str, Any]:
    """One token as a Chat Completions ``logprobs.content`` entry (also the Responses form)."""
    entry = _token(score.token_id, score.logprob, token_bytes)
    entry["top_logprobs"] = [_token(t, lp, token_bytes) for t, lp in score.top]
    return entry


def chat_logprobs(scores: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """A choice's ``logprobs`` object."""
    return {"content": [openai_logprob(s, token_bytes) for s in scores], "refusal": None}


def completion_logprobs(
    scores: Sequence[TokenLogprob], token_bytes: TokenBytes, offset: int = 0
) -> dict[str, Any]:
    """The legacy ``/v1/completions`` ``logprobs`` object; ``offset``: the text position of the first token."""
    tokens, offsets = [], []
    for score in scores:
        offsets.append(offset)
        text = token_bytes(score.token_id).decode("utf-8", errors="replace")
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(s.logprob) for s in scores],
        "top_logprobs": [
            {token_bytes(t).decode("utf-8", errors="replace"): _finite(lp) for t, lp in s.top} for s in scores
        ],
        "text_offset": offsets,
    }


def chat_message(output: ChatOutput) -> dict[str, Any]:
    """A choice's ``message``: ``content`` is a string (``""`` for an empty reply), null only beside tool
    calls, as OpenAI answers."""
    content = None if output.tool_calls and not output.content else output.content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if output.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in output.tool_calls]
    return message


def chat_delta(delta: ChatDelta) -> dict[str, Any]:
    """A streamed choice's ``delta`` (only the fields the piece has)."""
    body: dict[str, Any] = {}
    if delta.content:
        body["content"] = delta.content
    if delta.reasoning:
        body["reasoning_content"] = body["reasoning"] = delta.reasoning
    if delta.tool_calls:
        calls = []
        for part in delta.tool_calls:
            call: dict[str, Any] = {"index": part.index}
            function: dict[str, Any] = {"arguments": part.arguments}
            if part.id is not None:
                call.update(id=part.id, type="function")
                function["name"] = part.name
            call["function"] = function
            calls.append(call)
        body["tool_calls"] = calls
    return body
