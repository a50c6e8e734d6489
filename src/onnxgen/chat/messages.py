"""OpenAI chat messages made ready for a HF chat template.

OpenAI sends an assistant turn's tool-call arguments as JSON text; HF templates (Qwen's among them)
iterate them as a mapping (``tool_call.arguments | items``), so the text is parsed into an object here, as
vLLM does. The newer ``reasoning`` field of an assistant turn is also given to templates under the name
they read, ``reasoning_content``, and a ``tool`` message without a ``name`` gets the name of the call it
answers (some templates print it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from onnxgen.chat.tools import ChatInputError, Tool


def _arguments(where: str, value: object) -> object:
    if not isinstance(value, str):
        return value  # already an object (library callers may pass dicts)
    if not value.strip():
        return {}
    try:
        return json.loads(value)
    except ValueError as e:
        raise ChatInputError(
            f"{where} is not valid JSON ({e}); give the arguments of the call as a JSON object text"
        ) from e


def _tool_calls(index: int, calls: object, names: dict[str, str]) -> list[Any]:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatInputError(f"messages[{index}].tool_calls must be a list of calls (got {calls!r})")
    out: list[Any] = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ChatInputError(f"{where} must be an object such as {{'id': ..., 'function': {{...}}}}")
        call = dict(call)
        function = call.get("function")
        if isinstance(function, Mapping):
            function = dict(function)
            function["arguments"] = _arguments(f"{where}.function.arguments", function.get("arguments", "{}"))
            call["function"] = function
            if isinstance(call.get("id"), str) and isinstance(function.get("name"), str):
                names[call["id"]] = function["name"]
        out.append(call)
    return out


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` as chat templates expect them (see the module docstring); keys whose value
    is None are dropped, as HF templates test ``is defined`` rather than ``is none``."""
    names: dict[str, str] = {}  # tool-call id -> function name
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        item = {key: value for key, value in message.items() if value is not None}
        if "tool_calls" in item:
            item["tool_calls"] = _tool_calls(index, item["tool_calls"], names)
        if item.get("role") == "assistant" and "reasoning" in item and "reasoning_content" not in item:
            item["reasoning_content"] = item["reasoning"]
        if item.get("role") == "tool" and "name" not in item and item.get("tool_call_id") in names:
            item["name"] = names[item["tool_call_id"]]
        out.append(item)
    return out


def template_tools(tools: Sequence[Tool | Mapping[str, Any]]) -> list[Any]:
    """Tools as templates receive them: the Chat Completions form (``{"type": "function", "function": ...}``)."""
    return [tool.to_openai() if isinstance(tool, Tool) else tool for tool in tools]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # what the server's API takes too


def check_messages(messages: object) -> None:
    """Raise :class:`ChatInputError` where ``messages`` is not a chat to reply to: not a non-empty list,
    a message that is no mapping, or a role other than :data:`CHAT_ROLES` (the server refuses the same)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatInputError(
            f"messages must be a list of messages such as [{{'role': 'user', 'content': ...}}] (got {messages!r:.80})"
        )
    if not messages:
        raise ChatInputError("messages is empty; give at least one message, e.g. {'role': 'user', ...}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatInputError(
                f"messages[{index}] must be a mapping such as {{'role': 'user', 'content': ...}} "
                f"(got {message!r:.80})"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ChatInputError(
                f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)} (got {role!r})"
            )
