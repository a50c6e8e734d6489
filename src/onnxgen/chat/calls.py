"""Streaming tool-call extraction for formats that wrap each call in a start and an end tag.

:class:`ToolCallStream` splits a reply into content and calls as text arrives. Outside a call it streams
content, holding back a tail that may be the start of the start tag; inside one it hands the text to the
format's :class:`CallBody` scanner, which finds the function name and the arguments incrementally.

Rules (the same whichever way the text is chunked, except where marked):

- A call is *committed* once its name is complete and names a known tool (any valid name when no tools
  are given) and nothing before it in the text received so far is malformed: its header (id, name) is
  streamed, then its arguments piece by piece.
- A call found malformed before it is committed is returned as content: the start tag and the text after
  it are scanned again as ordinary text (a later start tag may still begin a valid call).
- A committed call that turns out malformed later (chunked streaming only: whole-text parsing sees the
  fault before committing) ends with the arguments streamed so far; the text after the fault is content.
  Under a tool-call grammar (:mod:`onnxgen.chat.grammar`) calls are always well-formed.
- Whitespace right before a call, and at the end of a reply that made calls, is dropped (it is layout).

- A call the reply ends inside (cut by the token limit: no end tag after its start) is dropped: it is
  neither a call nor content. Whole-text parsing never commits it; a stream that sends arguments as they
  come keeps a call it committed, its arguments cut short (what was sent cannot be taken back).
- A stream that holds calls (``hold_calls``: each call's deltas are sent whole once its end tag arrives,
  as the server streams them) sends nothing of a call before it is complete, so it reads every reply as
  whole-text parsing does, however the text is chunked: a cut call dropped, a malformed one content.

Whole-text parsing (:meth:`onnxgen.chat.parsers.ToolParser.parse`) is one feed with ``final=True``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from onnxgen.chat.deltas import ChatDelta, ToolCallDelta, partial_suffix
from onnxgen.chat.tools import TOOL_NAME, Tool, ToolCall, new_call_id

OPEN, DONE, FAILED = "open", "done", "failed"


class CallBody(ABC):
    """Scans the text of one call after its start tag, up to and including its end tag.

    After each :meth:`feed` the scanner is ``open`` (needs more text), ``done`` (``consumed`` characters
    of the body, end tag included, make the call) or ``failed`` (``consumed`` is where the fault is).
    ``name`` is set once the function name is complete and valid; :meth:`take_arguments` returns the
    arguments text that may be streamed since the previous call.
    """

    def __init__(self, tools: Mapping[str, Tool] | None) -> None:
        self.tools = tools
        self.status = OPEN
        self.name: str | None = None
        self.consumed = 0

    def known(self, name: str) -> bool:
        if self.tools is None:
            return TOOL_NAME.fullmatch(name) is not None
        return name in self.tools

    @abstractmethod
    def feed(self, text: str) -> None:
        """Scan ``text``, which follows what was fed before; stop at ``done`` or ``failed``."""

    @abstractmethod
    def finish(self) -> None:
        """No more text will come: become ``done`` if the call is complete enough, else ``failed``."""

    @abstractmethod
    def take_arguments(self) -> str:
        """Arguments text ready to stream (only asked once ``name`` is set)."""


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


class ToolCallStream:
    """Content and tool calls of one reply, parsed as its text arrives (see the module docstring)."""

    def __init__(
        self,
        start_tag: str,
        body: type[CallBody],
        tools: Sequence[Tool] | None = None,
        hold_calls: bool = False,
        end_tag: str | None = None,
    ) -> None:
        """``end_tag`` tells a call the reply ended inside (no end tag after its start) from a malformed
        one (None: every call still open at the end was cut)."""
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.hold_calls = hold_calls
        self._held: list[ChatDelta] = []  # the open call's deltas, with hold_calls
        self._body_type = body
        self._tools = None if tools is None else {t.name: t for t in tools}
        self._pending = ""  # text outside calls not yet streamed (a partial tag, trailing whitespace)
        self._body: CallBody | None = None
        self._body_text: list[str] = []  # the text of the open call after its start tag, in pieces
        self._committed: _Call | None = None
        self._content: list[str] = []
        self.calls: list[ToolCall] = []
        self._out: list[ChatDelta] = []

    # -- results ----------------------------------------------------------------------------------
    @property
    def content(self) -> str:
        return "".join(self._content)

    # -- streaming --------------------------------------------------------------------------------
    def feed(self, text: str, final: bool = False) -> list[ChatDelta]:
        """The deltas ``text`` completes, in output order; ``final``: ``text`` ends the reply."""
        self._run(text, final)
        return self._flush()

    def finish(self) -> list[ChatDelta]:
        """The deltas held back until the end of the reply."""
        return self.feed("", final=True)

    def _flush(self) -> list[ChatDelta]:
        out, self._out = self._out, []
        return out

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._out.append(ChatDelta(content=text))

    def _emit_call(self, delta: ToolCallDelta) -> None:
        (self._held if self.hold_calls else self._out).append(ChatDelta(tool_calls=(delta,)))

    def _run(self, text: str, final: bool) -> None:
        while True:
            if self._body is not None:
                text = self._in_call(text, final)
                if self._body is not None:
                    return  # the call needs more text
                continue  # what follows the call (or a failed call's text) is scanned as ordinary text
            text = self._outside(text, final)
            if self._body is None:
                return

    def _outside(self, text: str, final: bool) -> str:
        """Stream content from ``pending + text``; on a start tag open a call and return the text after it."""
        pending = self._pending + text
        at = pending.find(self.start_tag)
        if at >= 0:
            before = pending[:at]
            body = before.rstrip()
            self._emit_content(body)
            self._pending = before[len(body) :]  # whitespace kept until the call commits or fails
            self._body = self._body_type(self._tools)
            self._body_text = []
            return pending[at + len(self.start_tag) :]
        if final:
            self._pending = ""
            self._emit_content(pending if not self.calls else pending.rstrip())
            return ""
        hold = partial_suffix(pending, self.start_tag)
        head, tail = pending[: len(pending) - hold], pending[len(pending) - hold :]
        ready = head.rstrip()
        self._emit_content(ready)
        self._pending = head[len(ready) :] + tail
        return ""

    def _in_call(self, text: str, final: bool) -> str:
        """Feed the open call; return the text left over once it is done or failed."""
        body = self._body
        assert body is not None
        self._body_text.append(text)
        body.feed(text)
        if final and body.status == OPEN:
            body.finish()
            if body.status == FAILED and self._cut():  # the reply ended inside the call
                return self._drop_cut_call()
        if body.status != FAILED and body.name is not None and self._committed is None:
            self._commit(body.name)
        if self._committed is not None:
            piece = body.take_arguments()
            if piece:
                self._committed.arguments += piece
                self._emit_call(ToolCallDelta(len(self.calls), arguments=piece))
        if body.status == OPEN:
            return ""
        body_text = "".join(self._body_text)
        rest = body_text[body.consumed :]
        if body.status == FAILED and self.hold_calls:  # nothing of it was sent: read as the whole text is
            self._committed, self._held = None, []
        if body.status == FAILED and self._committed is None:  # malformed: the tag and its text are content
            self._emit_content(self._pending + self.start_tag)
            self._pending = ""
            rest = body_text
        else:
            self._close_call()
        self._body = None
        self._body_text = []
        return rest

    def _cut(self) -> bool:
        return self.end_tag is None or self.end_tag not in "".join(self._body_text)

    def _drop_cut_call(self) -> str:
        """Drop the call the reply ended inside (see the module docstring); a call whose arguments were
        already sent is kept as sent."""
        if self._committed is not None and not self.hold_calls:
            self._close_call()
        self._committed, self._held, self._pending = None, [], ""
        self._body, self._body_text = None, []
        return ""

    def _commit(self, name: str) -> None:
        if not self.hold_calls:  # whitespace before a call is dropped (held: once the call is complete)
            self._pending = ""
        self._committed = _Call(new_call_id(), name)
        self._emit_call(ToolCallDelta(len(self.calls), id=self._committed.id, name=name))

    def _close_call(self) -> None:
        call = self._committed
        assert call is not None
        self.calls.append(ToolCall(call.id, call.name, call.arguments))
        self._committed, self._pending = None, ""
        self._out.extend(self._held)
        self._held = []
