"""The ingress deployment: the HTTP front of the engine replicas.

It checks Host / Origin / API key with the server's own guard, reads the body with the server's own
limits, keys it by its prompt's leading parts and passes it to an engine replica through a handle (whose
router picks the replica), relaying the replica's response as it comes. A request whose replica fails
before any output reached the client is sent again; a stream cut later ends with an error event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from onnxgen.server.access import ENDPOINTS
from onnxgen.server.body import read_body
from onnxgen.server.protocol import ApiError, error_body
from onnxgen.server.security import Guard, SecurityConfig
from onnxgen.serving.affinity import RoutingKey, routing_key
from onnxgen.serving.asgi import ForwardedRequest, ResponseHead
from onnxgen.serving.metrics import IngressMetrics

REPLICA_HEADER = "x-onnxgen-replica"
PARSE_IN_THREAD_BYTES = 64 * 1024  # bodies parsed for their routing key off the event loop above this
REPLICA_FAILED = (RayActorError, DeploymentUnavailableError)
_HOP_HEADERS = (b"content-length", b"transfer-encoding", b"connection")


class OnnxgenIngress:
    """The HTTP front: guard, body, routing key, then the engine replica's response, relayed."""

    def __init__(self, engine: DeploymentHandle, security: SecurityConfig, retries: int) -> None:
        self.engine = engine.options(method_name="forward", stream=True)
        self.retries = retries
        self.metrics = IngressMetrics()
        routes = [
            Route("/metrics", self._metrics, methods=["GET"]),
            Route(
                "/{path:path}", self._forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
            ),
        ]
        self._asgi = Starlette(routes=routes, middleware=[Middleware(Guard, config=security)])

    def __serve_build_asgi_app__(self) -> Starlette:
        return self._asgi

    async def _metrics(self, request: Request) -> Response:
        self._count(request, 200)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _count(self, request: Request, status: int) -> None:
        self.metrics.requests.labels(ENDPOINTS.get(request.url.path, "other"), str(status)).inc()

    async def _forward(self, request: Request) -> Response:
        try:
            forwarded = await self._request(request)
            head, first, stream = await self._first_output(forwarded)
        except ApiError as e:
            self._count(request, e.status)
            return e.response()
        self._count(request, head.status)
        self.metrics.routed.labels(head.header(REPLICA_HEADER) or "", forwarded.route or "unkeyed").inc()
        headers = [(k, v) for k, v in head.headers if k.lower() not in _HOP_HEADERS]
        if stream is None:
            response = Response(b"".join(first), head.status)
            response.raw_headers = [*headers, (b"content-length", str(len(response.body)).encode())]
            return response
        response = StreamingResponse(self._relay(first, stream), head.status)
        response.raw_headers = headers
        return response

    async def _request(self, request: Request) -> ForwardedRequest:
        path = request.url.path
        keyed = request.method == "POST" and path in ("/v1/completions", "/v1/chat/completions")
        body = await read_body(request) if keyed else b""
        key = None
        if keyed:
            key = (
                await asyncio.to_thread(_key, path, body)
                if len(body) > PARSE_IN_THREAD_BYTES
                else _key(path, body)
            )
        client = tuple(request.scope["client"]) if request.scope.get("client") else None
        server = tuple(request.scope["server"]) if request.scope.get("server") else None
        return ForwardedRequest(
            request.method,
            path,
            request.scope.get("query_string", b""),
            list(request.scope["headers"]),
            body,
            client,
            server,
            key,
        )

    async def _first_output(
        self, forwarded: ForwardedRequest
    ) -> tuple[ResponseHead, list[bytes], DeploymentResponseGenerator | None]:
        """The head and the body up to the first output a client could have seen (all of it unless it is
        a stream), sending the request again, up to ``retries`` times, while its replica fails first."""
        for attempt in range(self.retries + 1):
            stream = self.engine.remote(forwarded)
            try:
                head = await stream.__anext__()
                if not isinstance(head, ResponseHead):
                    raise TypeError(f"the engine answered {type(head).__name__} before its response head")
                streaming = (head.header("content-type") or "").startswith("text/event-stream")
                first = await (_leading_events(stream) if streaming else _all(stream))
                return head, first, stream if streaming else None
            except BackPressureError as e:
                raise ApiError(
                    503,
                    f"every replica is busy and the queue is full ({e}); retry later",
                    "server_overloaded",
                ) from e
            except REPLICA_FAILED as e:
                stream.cancel()
                if attempt == self.retries:
                    raise ApiError(
                        503,
                        f"the replicas serving this request failed before answering ({e}); retry",
                        "server_error",
                    ) from e
                self.metrics.retries.inc()
            except BaseException:
                stream.cancel()  # the client went away: stop the generation
                raise
        raise AssertionError("unreachable")

    async def _relay(self, first: list[bytes], stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        try:
            for chunk in first:
                yield chunk
            async for chunk in stream:
                yield chunk
        except REPLICA_FAILED as e:
            self.metrics.broken.inc()
            message = f"the replica serving this request failed mid-stream ({e}); the response is incomplete"
            yield _sse_error(message)
        finally:
            stream.cancel()


def _key(path: str, body: bytes) -> RoutingKey | None:
    try:
        return routing_key(path, json.loads(body))
    except (ValueError, RecursionError):
        return None  # the replica refuses the body with the precise error


def _sse_error(message: str) -> bytes:
    return f"data: {json.dumps(error_body(message, 'server_error'))}\n\n".encode()


async def _all(stream: DeploymentResponseGenerator) -> list[bytes]:
    return [chunk async for chunk in stream]


def _carries_output(chunk: bytes) -> bool:
    """Whether SSE ``chunk`` holds more than the opening role chunks of a chat stream (which carry no
    token, so a request that has sent only them can still be sent again)."""
    for line in chunk.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return True
        choices = event.get("choices") if isinstance(event, dict) else None
        if not choices or any(c.get("delta") != {"role": "assistant", "content": ""} for c in choices):
            return True
    return False


async def _leading_events(stream: DeploymentResponseGenerator) -> list[bytes]:
    chunks: list[bytes] = []
    async for chunk in stream:
        chunks.append(chunk)
        if _carries_output(chunk):
            break
    return chunks
