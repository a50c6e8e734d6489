"""One log line and one ``onnxgen_requests_total`` count per HTTP request, whatever answered it.

The middleware sits outside every other layer, so requests refused by the guard, answered by an error
handler, or ended by an unhandled exception (a 500) are counted and logged like the others. Routes fill
in a :class:`RequestRecord` (token counts, and the prompt where ``--log-prompts`` asks for it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from onnxgen.server.metrics import ServerMetrics

log = logging.getLogger("onnxgen.server.access")

_RECORD = "onnxgen_request"
ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/models": "models",
    "/health": "health",
    "/metrics": "metrics",
}
MAX_LOGGED_PROMPT = 4096  # characters of a prompt in one log line


@dataclass
class RequestRecord:
    """What a route tells the request log beyond the status: tokens in and out, and the prompt."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt: Any = None


def request_record(request: Request) -> RequestRecord:
    """The record of ``request`` (a fresh one when the request did not pass the middleware)."""
    record = request.scope.get("state", {}).get(_RECORD)
    return record if isinstance(record, RequestRecord) else RequestRecord()


def _shown(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else repr(prompt)
    text = repr(text[:MAX_LOGGED_PROMPT])  # one line whatever the prompt holds
    more = len(prompt if isinstance(prompt, str) else repr(prompt)) - MAX_LOGGED_PROMPT
    return text + (f" (+{more} characters)" if more > 0 else "")


class RequestLog:
    """ASGI middleware: ``METHOD PATH STATUS prompt+completion tokens MS`` per request at INFO level."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, log_prompts: bool = False) -> None:
        self.app, self.metrics, self.log_prompts = app, metrics, log_prompts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord()
        scope.setdefault("state", {})[_RECORD] = record
        start = time.perf_counter()
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = status or 500  # the error handler outside this middleware answers 500
            raise
        finally:
            self._done(scope, status or 500, record, time.perf_counter() - start)

    def _done(self, scope: Scope, status: int, record: RequestRecord, seconds: float) -> None:
        self.metrics.requests.labels(ENDPOINTS.get(scope["path"], "other"), str(status)).inc()
        if not log.isEnabledFor(logging.INFO):
            return
        path = scope.get("raw_path") or scope["path"].encode()
        prompt = f" prompt={_shown(record.prompt)}" if self.log_prompts and record.prompt is not None else ""
        log.info(
            "%s %s %d tokens=%d+%d %.1f ms%s",
            scope["method"],
            path.decode("latin-1"),
            status,
            record.prompt_tokens,
            record.completion_tokens,
            1000 * seconds,
            prompt,
        )
