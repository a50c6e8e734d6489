"""The streaming event sequence of ``/v1/responses`` and the final response, built from parsed deltas.

:class:`ResponseBuilder` turns the :class:`~onnxgen.chat.deltas.ChatDelta` pieces of one reply into
output items in reply order (a ``reasoning`` item, a ``message`` item, ``function_call`` items) and the
events that stream them::

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added],
              response.reasoning_text.delta | response.output_text.delta | response.function_call_arguments.delta ...,
              response.reasoning_text.done | response.output_text.done | response.function_call_arguments.done,
              [response.content_part.done], response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens ran out).

A non-streamed request feeds the same builder and returns :attr:`ResponseBuilder.response`, so both
give the same object. Every event carries a ``sequence_number`` from 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from onnxgen.api.response_object import (
    FunctionCallOutput,
    MessageOutput,
    OutputItem,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseObject,
    Usage,
    new_id,
)
from onnxgen.chat.deltas import ChatDelta


class ResponseBuilder:
    """Output items and stream events of one response (see the module docstring)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._seq = 0
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallOutput] = {}  # by the parser's call index
        self._pending_logprobs: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def feed(
        self, deltas: Sequence[ChatDelta], logprobs: Sequence[dict[str, Any]] = ()
    ) -> list[dict[str, Any]]:
        """Events for the deltas of one step; ``logprobs`` (OpenAI form, one per token of the step) go
        with the answer text (a step that only thought drops them: reasoning has no logprobs)."""
        self._pending_logprobs.extend(logprobs)
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.reasoning:
                self._pending_logprobs.clear()
                events += self._reasoning(delta.reasoning)
            if delta.content:
                events += self._text(delta.content)
            for part in delta.tool_calls:
                events += self._call(part.index, part.id, part.name, part.arguments)
        return events

    def _switch(self, item: OutputItem) -> list[dict[str, Any]]:
        events = self._close()
        self._open = item
        self.response.output.append(item)
        index = len(self.response.output) - 1
        events.append(
            self._event("response.output_item.added", output_index=index, item=item.model_dump(mode="json"))
        )
        if isinstance(item, MessageOutput):
            item.content.append(OutputText())
            part = OutputText().model_dump(mode="json")
        elif isinstance(item, ReasoningOutput):
            item.content.append(ReasoningText())
            part = ReasoningText().model_dump(mode="json")
        else:
            return events
        events.append(
            self._event(
                "response.content_part.added", output_index=index, item_id=item.id, content_index=0, part=part
            )
        )
        return events

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = (
            [] if isinstance(self._open, ReasoningOutput) else self._switch(ReasoningOutput(id=new_id("rs")))
        )
        assert isinstance(self._open, ReasoningOutput)
        self._open.content[0].text += text
        events.append(self._item_event("response.reasoning_text.delta", content_index=0, delta=text))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = (
            [] if isinstance(self._open, MessageOutput) else self._switch(MessageOutput(id=new_id("msg")))
        )
        assert isinstance(self._open, MessageOutput)
        part = self._open.content[0]
        part.text += text
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        part.logprobs.extend(logprobs)
        brief = [{k: v for k, v in lp.items() if k != "bytes"} for lp in logprobs]
        for lp in brief:
            lp["top_logprobs"] = [
                {k: v for k, v in top.items() if k != "bytes"} for top in lp.get("top_logprobs", [])
            ]
        events.append(
            self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=brief)
        )
        return events

    def _call(
        self, index: int, call_id: str | None, name: str | None, arguments: str
    ) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if index not in self._calls:
            item = FunctionCallOutput(id=new_id("fc"), call_id=call_id or new_id("call"), name=name or "")
            self._calls[index] = item
            events += self._switch(item)
        if arguments:
            self._calls[index].arguments += arguments
            events.append(self._item_event("response.function_call_arguments.delta", delta=arguments))
        return events

    def _item_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self._open is not None
        return self._event(kind, output_index=len(self.response.output) - 1, item_id=self._open.id, **fields)

    def _close(self, status: Literal["completed", "incomplete"] = "completed") -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item.status = status
        index = self.response.output.index(item)
        events: list[dict[str, Any]] = []
        where = {"output_index": index, "item_id": item.id}
        if isinstance(item, MessageOutput):
            part = item.content[0]
            events.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=part.text, logprobs=[]
                )
            )
            events.append(
                self._event(
                    "response.content_part.done", **where, content_index=0, part=part.model_dump(mode="json")
                )
            )
        elif isinstance(item, ReasoningOutput):
            part_r = item.content[0]
            events.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=part_r.text)
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=part_r.model_dump(mode="json"),
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done", **where, arguments=item.arguments, name=item.name
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))
        )
        return events

    def finish(
        self,
        finish_reason: str,
        input_tokens: int,
        output_tokens: int,
        reasoning_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> list[dict[str, Any]]:
        """Close the last item and end the response: ``response.completed``, or ``response.incomplete``
        (``max_output_tokens``) when the reply was cut at the token limit. ``cached_tokens``: input tokens
        resumed from the prefix cache rather than prefilled."""
        cut = finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        self.response.usage = Usage(
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
            input_tokens_details={"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            output_tokens_details={"reasoning_tokens": reasoning_tokens},
        )
        self.response.status = "incomplete" if cut else "completed"
        self.response.incomplete_details = {"reason": "max_output_tokens"} if cut else None
        self.response.completed_at = None if cut else time.time()
        kind = "response.incomplete" if cut else "response.completed"
        events.append(self._event(kind, response=self._snapshot()))
        return events

    def fail(self, message: str, code: str = "server_error") -> list[dict[str, Any]]:
        """End the response as failed (an engine error after streaming began)."""
        self.response.status = "failed"
        self.response.error = {"code": code, "message": message}
        return [self._event("response.failed", response=self._snapshot())]
