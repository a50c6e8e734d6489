"""Responses API input as chat messages, and a finished response as the conversation it continues.

- ``instructions`` become a leading system message; they belong to one request and are not carried to
  the next one through ``previous_response_id`` (as in OpenAI's API).
- A text ``input`` is one user message; ``developer`` messages are system messages.
- ``function_call`` items become the ``tool_calls`` of an assistant message (consecutive calls, and an
  assistant message right before them, make one turn); ``function_call_output`` items become ``tool``
  messages; a ``reasoning`` item gives its text to the next assistant turn as ``reasoning_content``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onnxgen.api.response_object import FunctionCallOutput, MessageOutput, ReasoningOutput, ResponseObject
from onnxgen.api.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)


def _text(content: str | Sequence[object]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if isinstance(part, TextPart))


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn that function calls join: the last message if it is one without a tool
    result after it, else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``request.input`` (without ``instructions``)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in request.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message: dict[str, Any] = {"role": role, "content": _text(item.content)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            turn = _assistant(messages)
            if reasoning is not None:
                turn["reasoning_content"], reasoning = reasoning, None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            turn.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif isinstance(item, ReasoningItem):
            reasoning = _text(item.content or item.summary)
    return messages


def chat_messages(request: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The messages the model reads: ``instructions``, then the conversation of the previous response
    (``history``, from :func:`conversation`), then this request's input."""
    head = [{"role": "system", "content": request.instructions}] if request.instructions else []
    return [*head, *history, *input_messages(request)]


def output_message(response: ResponseObject) -> dict[str, Any] | None:
    """The assistant turn a finished response adds to the conversation (None when it output nothing)."""
    content, reasoning, calls = "", None, []
    for item in response.output:
        if isinstance(item, MessageOutput):
            content += "".join(part.text for part in item.content)
        elif isinstance(item, ReasoningOutput):
            reasoning = (reasoning or "") + "".join(part.text for part in item.content)
        elif isinstance(item, FunctionCallOutput):
            calls.append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
    if not (content or reasoning or calls):
        return None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def conversation(
    request: ResponsesRequest, history: Sequence[dict[str, Any]], response: ResponseObject
) -> list[dict[str, Any]]:
    """The conversation a later request continues with ``previous_response_id`` (no instructions)."""
    reply = output_message(response)
    return [*history, *input_messages(request), *([reply] if reply is not None else [])]
