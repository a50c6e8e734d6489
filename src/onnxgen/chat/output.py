"""Reasoning and tool calls parsed together from one reply, whole or streamed.

The reasoning section comes first; tool calls are looked for in the answer only (a call written while
thinking is part of the thinking).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from onnxgen.chat.deltas import ChatDelta
from onnxgen.chat.parsers import ToolParser
from onnxgen.chat.reasoning import ReasoningFormat, ReasoningStream
from onnxgen.chat.tools import Tool, ToolCall


@dataclass(frozen=True)
class ChatOutput:
    """A parsed reply: the answer, the thinking (None when the reply had no reasoning section) and calls."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatStream:
    """Parses one reply as its text arrives: :meth:`feed` and :meth:`finish` return the deltas in output
    order; :attr:`output` is the parsed reply so far (complete after :meth:`finish`)."""

    def __init__(
        self,
        reasoning: ReasoningFormat | None = None,
        opened: bool = False,
        tool_parser: ToolParser | None = None,
        tools: Sequence[Tool] | None = None,
        hold_calls: bool = False,
    ) -> None:
        self._reasoning: ReasoningStream | None = reasoning.stream(opened) if reasoning else None
        self._calls = tool_parser.stream(tools, hold_calls) if tool_parser else None
        self._content: list[str] = []

    def feed(self, text: str, final: bool = False) -> list[ChatDelta]:
        """The deltas ``text`` completes, in output order; ``final``: ``text`` ends the reply (a call
        still open is then dropped, unless a stream already sent it: :mod:`onnxgen.chat.calls`)."""
        if self._reasoning is None:
            deltas = [ChatDelta(content=text)] if text else []
        else:
            deltas = self._reasoning.feed(text)
            if final:
                deltas += self._reasoning.finish()
        return self._route(deltas, final)

    def finish(self) -> list[ChatDelta]:
        return self.feed("", final=True)

    def _route(self, deltas: list[ChatDelta], final: bool) -> list[ChatDelta]:
        """Pass answer text through the tool-call parser; reasoning (which precedes it) goes out as it is."""
        if self._calls is None:
            self._content.extend(delta.content for delta in deltas)
            return deltas
        out = [delta for delta in deltas if not delta.content]
        answer = "".join(delta.content for delta in deltas)
        if answer or final:
            out.extend(self._calls.feed(answer, final))
        return out

    @property
    def output(self) -> ChatOutput:
        reasoning = self._reasoning.reasoning if self._reasoning else None
        if self._calls is not None:
            return ChatOutput(self._calls.content, reasoning, list(self._calls.calls))
        return ChatOutput("".join(self._content), reasoning, [])


def parse_output(
    text: str,
    reasoning: ReasoningFormat | None = None,
    opened: bool = False,
    tool_parser: ToolParser | None = None,
    tools: Sequence[Tool] | None = None,
) -> ChatOutput:
    """The whole reply ``text`` parsed at once."""
    stream = ChatStream(reasoning, opened, tool_parser, tools)
    stream.feed(text, final=True)
    return stream.output
