"""Running an ASGI app in this process for requests that arrive as data, with streamed responses.

A Ray replica gets a request as a :class:`ForwardedRequest` (method, path, headers, body) from the
ingress and runs it through the same FastAPI app ``onnxgen serve`` runs: :class:`AppRunner` plays the
ASGI server's part (lifespan, one scope per request, a disconnect when the caller stops listening)
and yields the response as a :class:`ResponseHead` then body chunks, as the app sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

from onnxgen.serving.affinity import RoutingKey


@dataclass
class ForwardedRequest:
    """One HTTP request as the ingress passes it on: everything the app reads, and how to route it.

    ``route`` is filled in by the router (how it chose the replica), for the ingress's metrics.
    """

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None
    routing: RoutingKey | None = None
    route: str = ""


@dataclass(frozen=True)
class ResponseHead:
    """The status and headers of a response; its body follows as ``bytes`` chunks."""

    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: str) -> str | None:
        key = name.lower().encode("latin-1")
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), None)


def _error_response(status: int, message: str) -> tuple[ResponseHead, bytes]:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
    return ResponseHead(status, [(b"content-type", b"application/json")]), body.encode()


class AppRunner:
    """An ASGI app driven in process: :meth:`start` / :meth:`stop` run its lifespan, :meth:`call` a request."""

    def __init__(self, app: ASGIApp, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.app = app
        self.extra_headers = list(extra_headers or [])
        self._lifespan: asyncio.Task[None] | None = None
        self._shutdown = asyncio.Event()
        self._state: dict[str, Any] = {}

    async def start(self) -> None:
        """Run the app's startup (its scheduler thread starts); raise if it fails."""
        started: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        sent_startup = False

        async def receive() -> Message:
            nonlocal sent_startup
            if not sent_startup:
                sent_startup = True
                return {"type": "lifespan.startup"}
            await self._shutdown.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: Message) -> None:
            if message["type"].startswith("lifespan.startup") and not started.done():
                started.set_result(message)

        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self._state}

        async def lifespan() -> None:
            await self.app(scope, receive, send)

        self._lifespan = asyncio.create_task(lifespan())
        first: set[asyncio.Future[Any]] = {self._lifespan, started}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not started.done() or started.result()["type"] != "lifespan.startup.complete":
            message = started.result().get("message", "") if started.done() else "the app ended"
            raise RuntimeError(f"the app's startup failed: {message}")

    async def stop(self) -> None:
        """Run the app's shutdown (its scheduler stops, ending what still runs with an error)."""
        self._shutdown.set()
        if self._lifespan is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lifespan, 30)

    async def call(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The response to ``request``: its head, then its body chunks as the app sends them.

        Closing the iterator early (the caller went away) tells the app the client disconnected, which
        cancels the request's generation.
        """
        messages: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await messages.put(message)

        errors: list[Exception] = []

        async def run() -> None:
            try:
                await self.app(self._scope(request), receive, send)
            except Exception as e:  # the app's error handler has answered 500 where it could
                errors.append(e)
            finally:
                await messages.put(None)

        task = asyncio.create_task(run())
        started = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    started = True
                    headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
                    yield ResponseHead(int(message["status"]), headers + self.extra_headers)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
            if not started:  # the app ended without answering (an exception escaped it)
                head, body = _error_response(500, f"internal error: {errors[0] if errors else 'no response'}")
                yield ResponseHead(head.status, head.headers + self.extra_headers)
                yield body
        finally:
            gone.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(task, 5)

    def _scope(self, request: ForwardedRequest) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode("utf-8"),
            "query_string": request.query,
            "root_path": "",
            "headers": list(request.headers),
            "client": request.client,
            "server": request.server,
            "state": dict(self._state),
        }
