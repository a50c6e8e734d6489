"""The split of a thinking model's reply into reasoning and answer: ``<think> ... </think> answer``.

Two layouts occur. Qwen3 lets the model open ``<think>`` itself (the reply starts with it, or has no
thinking); Qwen3.5 opens it in the generation prompt, so the reply holds only ``</think>``. Which one a
request has is read from its rendered prompt (:func:`reasoning_opened`): the prompt opened a section when
its last ``<think>`` comes after its last ``</think>``.

Whitespace around the tags is layout: the reasoning is stripped at both ends and the answer loses the
whitespace that follows ``</think>``. A reply that ends inside the section (cut short) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnxgen.chat.deltas import ChatDelta, partial_suffix

THINK_START, THINK_END = "<think>", "</think>"
_BEFORE, _REASONING, _ANSWER = range(3)


def reasoning_opened(prompt: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """True when ``prompt`` leaves a reasoning section open (the reply starts inside it)."""
    opened = prompt.rfind(start)
    return opened >= 0 and opened > prompt.rfind(end)


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags of a reasoning section."""

    start: str = THINK_START
    end: str = THINK_END

    def stream(self, opened: bool) -> ReasoningStream:
        return ReasoningStream(self, opened)

    def parse(self, text: str, opened: bool) -> tuple[str | None, str]:
        """``(reasoning, answer)`` of a whole reply; reasoning is None when the reply has no section."""
        stream = ReasoningStream(self, opened)
        stream.feed(text)
        stream.finish()
        return stream.reasoning, stream.content


class ReasoningStream:
    """Reasoning and answer of one reply, split as its text arrives (see the module docstring)."""

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self.format = fmt
        self._state = _REASONING if opened else _BEFORE
        self._seen = opened  # a reasoning section was entered
        self._pending = ""  # text held back: a partial tag, or whitespace at the end of the reasoning
        self._started = False  # some reasoning text was emitted (leading whitespace is dropped until then)
        self._strip_answer = False
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) if self._seen else None

    @property
    def content(self) -> str:
        return "".join(self._content)

    def feed(self, text: str) -> list[ChatDelta]:
        return self._run(self._pending + text, final=False)

    def finish(self) -> list[ChatDelta]:
        return self._run(self._pending, final=True)

    def _run(self, text: str, final: bool) -> list[ChatDelta]:
        self._pending = ""
        out: list[ChatDelta] = []
        if self._state == _BEFORE:
            text = self._before(text, final)
            if self._state == _BEFORE:
                return out
        if self._state == _REASONING:
            text = self._in_reasoning(text, final, out)
            if self._state == _REASONING:
                return out
        if self._strip_answer:
            stripped = text.lstrip()
            if not stripped and not final:
                return out
            self._strip_answer, text = False, stripped
        if text:
            self._content.append(text)
            out.append(ChatDelta(content=text))
        return out

    def _before(self, text: str, final: bool) -> str:
        """Decide whether the reply opens a section; return the text left to route."""
        head = text.lstrip()
        if head.startswith(self.format.start):
            self._state, self._seen = _REASONING, True
            return head[len(self.format.start) :]
        if not final and self.format.start.startswith(head):
            self._pending = text  # may still become the start tag
            return ""
        self._state = _ANSWER
        return text

    def _in_reasoning(self, text: str, final: bool, out: list[ChatDelta]) -> str:
        """Emit reasoning from ``text``; on the end tag switch to the answer and return what follows it."""
        end = text.find(self.format.end)
        if end >= 0:
            self._emit_reasoning(text[:end].rstrip(), out)
            self._state, self._strip_answer = _ANSWER, True
            return text[end + len(self.format.end) :]
        if final:
            self._emit_reasoning(text.rstrip(), out)
            return ""
        hold = partial_suffix(text, self.format.end)
        ready = text[: len(text) - hold]
        body = ready.rstrip()
        self._emit_reasoning(body, out)
        self._pending = ready[len(body) :] + text[len(text) - hold :]
        return ""

    def _emit_reasoning(self, text: str, out: list[ChatDelta]) -> None:
        if not self._started:
            text = text.lstrip()
        if text:
            self._started = True
            self._reasoning.append(text)
            out.append(ChatDelta(reasoning=text))
