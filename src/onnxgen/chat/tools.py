"""Tool definitions, ``tool_choice`` and parsed tool calls, as the OpenAI chat and Responses APIs give them.

Chat Completions nests a function (``{"type": "function", "function": {"name": ..., "parameters": ...}}``);
the Responses API flattens it (``{"type": "function", "name": ..., "parameters": ...}``). Both become a
:class:`Tool`. Every malformed field raises :class:`ChatInputError` naming the field and the fix.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from onnxgen.errors import GenerationError

MAX_TOOLS = 128  # the OpenAI limit; each tool adds to the prompt and to the grammar
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
CHOICE_MODES = ("none", "auto", "required")


class ChatInputError(GenerationError, ValueError):
    """A tool definition, ``tool_choice`` or chat message is malformed."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and JSON schema of the arguments."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The Chat Completions form, which chat templates receive as ``tools``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}

    @property
    def properties(self) -> Mapping[str, Any]:
        """The schemas of the named arguments (``parameters.properties``; empty when absent)."""
        props = self.parameters.get("properties")
        return props if isinstance(props, Mapping) else {}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is ``"none"``, ``"auto"``, ``"required"`` or ``"named"`` (then ``name`` is the function)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text (an object), as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The Chat Completions ``message.tool_calls[i]`` form."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's style (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool(index: int, raw: object) -> Tool:
    where = f"tools[{index}]"
    if isinstance(raw, Tool):
        return raw
    if not isinstance(raw, Mapping) or raw.get("type", "function") != "function":
        raise ChatInputError(
            f"{where} must be a function tool such as {{'type': 'function', 'function': {{'name': ..., "
            f"'parameters': {{...}}}}}} (got {raw!r}); only function tools are supported"
        )
    spec = raw.get("function", raw)  # Chat Completions nests the function; the Responses API does not
    if not isinstance(spec, Mapping):
        raise ChatInputError(f"{where}.function must be an object with a name (got {spec!r})")
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ChatInputError(
            f"{where} has the name {name!r}; a tool name must be 1 to 64 letters, digits, '_', '-', '.' or ':'"
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise ChatInputError(f"{where}.description must be a string (got {description!r})")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise ChatInputError(f"{where}.parameters must be a JSON schema object (got {parameters!r})")
    try:
        parameters = json.loads(
            json.dumps(parameters, allow_nan=False)
        )  # plain JSON, detached from the caller
    except (TypeError, ValueError) as e:
        raise ChatInputError(f"{where}.parameters is not JSON-serializable: {e}") from e
    strict = spec.get("strict")
    return Tool(name, description, parameters, strict if isinstance(strict, bool) else None)


def parse_tools(raw: Sequence[object] | None) -> list[Tool]:
    """The tools of a request (OpenAI chat or Responses form, or :class:`Tool`); names must be unique."""
    if raw is None:
        return []
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        raise ChatInputError(f"tools must be a list of function tools (got {raw!r})")
    if len(raw) > MAX_TOOLS:
        raise ChatInputError(f"tools has {len(raw)} entries; at most {MAX_TOOLS} tools are accepted")
    tools = [_tool(i, item) for i, item in enumerate(raw)]
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ChatInputError(f"tools defines {tool.name!r} twice; give each function a unique name")
        seen.add(tool.name)
    return tools


def parse_tool_choice(raw: object, tools: Sequence[Tool]) -> ToolChoice:
    """``tool_choice`` as a :class:`ToolChoice`: ``None`` means ``"auto"`` with tools, ``"none"`` without."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, ToolChoice):
        choice = raw
    elif isinstance(raw, str):
        if raw not in CHOICE_MODES:
            raise ChatInputError(
                f"tool_choice must be one of {', '.join(CHOICE_MODES)} or a named function (got {raw!r})"
            )
        choice = ToolChoice(raw)
    elif isinstance(raw, Mapping) and raw.get("type") == "function":
        spec = raw.get("function", raw)
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if not isinstance(name, str):
            raise ChatInputError(
                f"tool_choice names no function (got {raw!r}); give {{'type': 'function', ...}}"
            )
        choice = ToolChoice("named", name)
    else:
        raise ChatInputError(
            f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}} "
            f"(got {raw!r})"
        )
    if choice.forces_call and not tools:
        raise ChatInputError(f"tool_choice {raw!r} asks for a tool call, but the request defines no tools")
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        raise ChatInputError(
            f"tool_choice names {choice.name!r}, which is not among the tools ({', '.join(t.name for t in tools)})"
        )
    return choice
