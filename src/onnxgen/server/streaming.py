"""Turning a request's deltas into an OpenAI response: collected (one body) or streamed (SSE chunks)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from onnxgen.generation.logprobs import TokenLogprob
from onnxgen.server.access import RequestRecord
from onnxgen.server.protocol import ApiError, error_body, usage
from onnxgen.server.sequence import Delta, Handle
from onnxgen.server.shapes import ChoiceResult, ResponseShape

log = logging.getLogger(__name__)

DISCONNECTED = "disconnected"
MAX_UNREAD_STEPS = 256  # scheduler steps of deltas a stream may hold unread before its request ends


class RequestStream:
    """The deltas of one request as the asyncio side sees them, and its cancellation.

    The deltas wait here until the response takes them; a streamed response takes them only as fast as
    its client reads. A client that stops reading would make them pile up for as long as the request
    decodes, so once :data:`MAX_UNREAD_STEPS` steps' deltas wait unread the request is cancelled (its
    rows freed) and ends with an error that says why, should the client read on."""

    def __init__(self, choices: int, prompt_tokens: int, wake: Callable[[], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[Delta] | str] = asyncio.Queue()
        self.handle = Handle(self._push)
        self.choices = choices
        self.prompt_tokens = prompt_tokens
        self._wake = wake
        self._unread = 0  # pushes not taken yet (counted on both threads, under the lock)
        self._lock = threading.Lock()

    def _push(self, deltas: list[Delta]) -> None:  # called from the scheduler thread
        with self._lock:
            self._unread += 1
            unread = self._unread
        if unread > MAX_UNREAD_STEPS and not self.handle.cancelled:
            self.handle.cancelled = True  # the scheduler ends the request at its next step
            ended = [d for d in deltas if d.finish_reason is None or d.error is not None]
            message = (
                f"the client read none of this stream's last {MAX_UNREAD_STEPS} steps; the request was "
                "ended to bound the server's memory (read streamed responses as they arrive)"
            )
            index = ended[0].index if ended else 0
            deltas = [*deltas, Delta(index, -1, "", "error", message)]
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, deltas)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.handle.cancelled = True

    async def next(self) -> list[Delta] | str:
        """The next deltas pushed (or :data:`DISCONNECTED`). Always lets the event loop run other
        tasks first: a response catching up on many queued steps (its client was slow to read) would
        otherwise build and send them all in one go, with /health and other streams waiting."""
        await asyncio.sleep(0)
        item = await self.queue.get()
        if item != DISCONNECTED:
            with self._lock:
                self._unread -= 1
        return item

    def cancel(self) -> None:
        self.handle.cancelled = True
        self._wake()


@dataclass
class Collected:
    texts: list[list[str]]
    reasons: list[str | None]
    token_ids: list[list[int]]
    scores: list[list[TokenLogprob]]
    error: str | None = None
    client_error: bool = False  # the request caused ``error`` (a 400, not a 500)
    disconnected: bool = False

    def failure(self) -> Response | None:
        """What a request that did not finish answers: 499 after the client left, else None; raises the
        ``ApiError`` of a failed request (400 where the request caused it, else 500)."""
        if self.disconnected:
            return Response(status_code=499)
        if self.error is not None:
            if self.client_error:
                raise ApiError(400, self.error)
            raise ApiError(500, self.error, "server_error")
        return None

    def results(self) -> list[ChoiceResult]:
        return [
            ChoiceResult("".join(texts), reason, ids, scores)
            for texts, reason, ids, scores in zip(
                self.texts, self.reasons, self.token_ids, self.scores, strict=True
            )
        ]


async def _watch_disconnect(request: Request, queue: asyncio.Queue[Any]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(DISCONNECTED)
            return


async def collect(stream: RequestStream, request: Request) -> Collected:
    """Wait for every choice to finish; a client disconnect cancels the request."""
    k = stream.choices
    out = Collected([[] for _ in range(k)], [None] * k, [[] for _ in range(k)], [[] for _ in range(k)])
    remaining = stream.choices
    watcher = asyncio.create_task(_watch_disconnect(request, stream.queue))
    try:
        while remaining:
            item = await stream.next()
            if isinstance(item, str):  # DISCONNECTED
                stream.cancel()
                out.disconnected = True
                return out
            for delta in item:
                if delta.error is not None:  # finally cancels the request's other choices
                    out.error, out.client_error = delta.error, delta.client_error
                    return out
                out.texts[delta.index].append(delta.text)
                out.token_ids[delta.index].append(delta.token_id)
                if delta.logprob is not None:
                    out.scores[delta.index].append(delta.logprob)
                if delta.finish_reason is not None:
                    out.reasons[delta.index] = delta.finish_reason
                    remaining -= 1
        return out
    finally:
        watcher.cancel()
        if remaining:
            stream.cancel()


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse_events(
    stream: RequestStream,
    shape: ResponseShape,
    include_usage: bool,
    record: RequestRecord | None = None,
) -> AsyncIterator[str]:
    """OpenAI chunks as tokens arrive (built by ``shape``); with ``stream_options.include_usage`` the
    usage comes once, on a final chunk with no choices, as OpenAI sends it. ``record`` gets the count of
    tokens streamed, for the request log."""
    remaining = stream.choices
    tokens = 0
    try:
        for chunk in shape.first_chunks():
            yield _sse(chunk)
        while remaining:
            item = await stream.next()
            if isinstance(item, str):  # DISCONNECTED: pushed only where a watcher runs (collect), not here
                return
            for delta in item:
                if delta.error is not None:  # the request ends here; finally cancels its other choices
                    kind = "invalid_request_error" if delta.client_error else "server_error"
                    yield _sse(error_body(delta.error, kind))
                    return
                tokens += 1
                if record is not None:
                    record.completion_tokens = tokens
                if delta.finish_reason is not None:
                    remaining -= 1
                body = shape.chunk(delta)
                if body is not None:
                    yield _sse(body)
        if include_usage:
            yield _sse(shape.usage_chunk(usage(stream.prompt_tokens, tokens, stream.handle.cached_tokens)))
        yield "data: [DONE]\n\n"
    except Exception as e:  # a bug here must not end the stream without a word
        log.exception("streaming a response failed")
        yield _sse(error_body(f"internal error while streaming: {e}", "server_error"))
    finally:
        if remaining:  # the client went away (the response task was cancelled) or the server stops
            stream.cancel()
