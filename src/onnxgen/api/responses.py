"""The ``/v1/responses`` request and response object, shaped as the official ``openai`` client's types.

Supported: ``input`` as text or items (messages, ``function_call``, ``function_call_output``,
``reasoning``), ``instructions``, function ``tools`` with ``tool_choice`` and ``parallel_tool_calls``,
``reasoning.effort``, ``text.format`` (``text``, ``json_object``, ``json_schema``), ``max_output_tokens``,
``temperature``, ``top_p``, ``top_logprobs``, ``stream``, ``previous_response_id``, ``store``,
``metadata``. Unknown fields are ignored; fields whose value asks for something onnxgen cannot do
(built-in tools, images, background mode) are refused by :meth:`ResponsesRequest.refuse_unsupported`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from onnxgen.generation.params import MAX_TOP_LOGPROBS


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    """Text content of an input message (``input_text``; ``output_text`` in replayed assistant turns)."""

    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class OtherPart(_Lenient):
    """A content part onnxgen does not read (images, files); refused with a message naming it."""

    type: str


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return (
        "text" if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text") else "other"
    )


Part = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[OtherPart, Tag("other")], Discriminator(_part_tag)
]


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]
    id: str | None = None


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Part] = Field(default_factory=list)
    content: list[Part] | None = None


class OtherItem(_Lenient):
    """An input item onnxgen does not handle (file search calls, images, item references, ...)."""

    type: str


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in _ITEM_TYPES else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_tag),
]


class FunctionToolSpec(_Lenient):
    """A tool of the request (the Responses API's flat function form, or another type to refuse)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    background: bool | None = None
    conversation: Any = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # the prefix-cache partition

    def refuse_unsupported(self) -> tuple[str, str] | None:
        """``(field, message)`` for a request onnxgen cannot serve as asked, or None."""
        if self.background:
            return "background", "background responses are not supported; omit background or set it to false"
        if self.conversation is not None:
            return (
                "conversation",
                "conversations are not supported; chain responses with previous_response_id",
            )
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function":
                return f"tools[{i}]", f"tool type {tool.type!r} is not supported; only function tools are"
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            if isinstance(item, OtherItem):
                return f"input[{i}]", f"input item type {item.type!r} is not supported; send messages, "
                "function_call and function_call_output items"
            parts = [
                *(item.content if isinstance(item, MessageItem) and isinstance(item.content, list) else []),
                *(
                    item.output
                    if isinstance(item, FunctionCallOutputItem) and isinstance(item.output, list)
                    else []
                ),
            ]
            for part in parts:
                if isinstance(part, OtherPart):
                    return f"input[{i}].content", f"content type {part.type!r} is not supported; send text"
        return None

    def chat_tools(self) -> list[dict[str, Any]]:
        """The tools in the Chat Completions form."""
        return [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", tool.name),
                        ("description", tool.description),
                        ("parameters", tool.parameters),
                        ("strict", tool.strict),
                    )
                    if v is not None
                },
            }
            for tool in self.tools or []
        ]

    def chat_tool_choice(self) -> object:
        """``tool_choice`` in the Chat Completions form."""
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as a Chat Completions ``response_format``."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_ or {}},
        }

    def template_kwargs(self) -> dict[str, Any]:
        """Chat template variables from ``reasoning.effort`` (see :func:`effort_kwargs`)."""
        return effort_kwargs(self.reasoning.effort if self.reasoning is not None else None)


def effort_kwargs(effort: str | None) -> dict[str, Any]:
    """Chat template variables for a reasoning effort: ``reasoning_effort`` (templates that read it), and
    ``enable_thinking=False`` for ``"none"`` (Qwen3's switch)."""
    if effort is None:
        return {}
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}
