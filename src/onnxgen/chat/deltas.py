"""What the streaming parsers emit: pieces of content, of reasoning, and of tool calls, in output order.

A call streams as OpenAI streams it: its first :class:`ToolCallDelta` carries the ``id`` and ``name``
(and no arguments), later ones carry pieces of the ``arguments`` JSON text; joined in order, the pieces
are the call's arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call number ``index`` (0-based within the reply)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ChatDelta:
    """One piece of a reply: text of the answer (``content``), of the thinking (``reasoning``), or calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def merge_deltas(deltas: Iterable[ChatDelta]) -> ChatDelta:
    """One delta holding all of ``deltas`` (texts joined; call pieces kept in order), for protocols whose
    stream chunk carries every field at once (Chat Completions)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallDelta] = []
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        calls.extend(delta.tool_calls)
    return ChatDelta("".join(content), "".join(reasoning), tuple(calls))


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (held back while
    streaming: the next chunk may complete the tag)."""
    at = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while at >= 0:
        if tag.startswith(text[at:]):
            return len(text) - at
        at = text.find(tag[0], at + 1)
    return 0
