"""onnxgen on Ray Serve: engine replicas behind one OpenAI-compatible ingress, with prefix-aware routing.

Two deployments make the application (:func:`build_app`):

- ``OnnxgenEngine``: N replicas, each one engine with its own continuous batching, running the very app
  ``onnxgen serve`` runs (:func:`onnxgen.serving.engine.load_app`), fed in process
  (:class:`~onnxgen.serving.asgi.AppRunner`). Routes, errors, streaming and per-request logs are that
  app's; every response says which replica served it (header ``x-onnxgen-replica``). Each replica
  takes at most ``max_batch + max_queue`` requests at once (``max_ongoing_requests``), so a busy
  deployment queues at the ingress, at most ``max_queue`` requests, then answers 503 like a full
  ``onnxgen serve``. With ``min_replicas``/``max_replicas`` Ray Serve scales the replicas on the
  requests in flight per replica (target: ``max_batch``). Its metrics go to Ray's metrics, per replica.
- ``OnnxgenIngress``: checks Host / Origin / API key like the engine does, reads the body (same limits),
  keys it by its prompt's leading parts (:mod:`onnxgen.serving.affinity`) and passes it on through a
  handle whose router, :class:`PrefixAffinityRouter`, prefers the replica that holds the prefix. A
  request whose replica dies before any output reached the client is sent again to another replica; a
  stream cut later ends with an error event. ``/metrics`` here shows the ingress's own counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from onnxgen.server.access import ENDPOINTS
from onnxgen.server.body import read_body
from onnxgen.server.protocol import ApiError, error_body
from onnxgen.server.security import Guard, SecurityConfig
from onnxgen.serving.affinity import AffinityTable, RoutingKey, choose, routing_key
from onnxgen.serving.asgi import AppRunner, ForwardedRequest, ResponseHead
from onnxgen.serving.engine import EngineSpec, load_app
from onnxgen.serving.metrics import IngressMetrics, RegistryMirror

APP_NAME = "onnxgen"
REPLICA_HEADER = "x-onnxgen-replica"
METRICS_PERIOD_S = 5.0
PARSE_IN_THREAD_BYTES = 64 * 1024  # bodies parsed for their routing key off the event loop above this
REPLICA_FAILED = (RayActorError, DeploymentUnavailableError)
_HOP_HEADERS = (b"content-length", b"transfer-encoding", b"connection")


# -- routing ---------------------------------------------------------------------------------------------
class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: a replica holding the request's prefix first (see
    :func:`onnxgen.serving.affinity.choose`), then the least loaded of two random others.

    Replicas may report the prefix digests their prefix cache holds as ``prefix_keys`` in their routing
    stats (a deployment's ``record_routing_stats``); the router prefers them to its own memory.
    """

    def initialize_state(self, slack: int = 16, capacity: int = 100_000) -> None:
        self.slack = slack
        self.table = AffinityTable(capacity)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        request = _forwarded(pending_request)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {name: cache.get(r.replica_id) for name, r in by_id.items()}
        held = {name: r.routing_stats.get("prefix_keys", ()) for name, r in by_id.items()}
        key = request.routing if request is not None else None
        choice = choose(key, list(by_id), loads, self.table, self.slack, held)
        if request is not None:
            request.route = choice.how
        others = [r for name, r in by_id.items() if name != choice.replica]
        fallback = random.sample(others, min(2, len(others)))
        if choice.replica is None:
            return [fallback]
        return [[by_id[choice.replica]], fallback] if fallback else [[by_id[choice.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _forwarded(pending_request)
        if request is not None and request.routing is not None:
            self.table.record(request.routing, replica_id.to_full_id_str())


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, ForwardedRequest) else None


# -- the engine replicas ---------------------------------------------------------------------------------
class OnnxgenEngine:
    """One engine replica: the ``onnxgen serve`` app, driven in process."""

    async def __init__(self, spec: EngineSpec) -> None:
        app, _ = await asyncio.to_thread(load_app, spec)
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        self.runner = AppRunner(app, [(REPLICA_HEADER.encode(), self.name.encode())])
        await self.runner.start()
        self.mirror = RegistryMirror(app.state.server.metrics.registry, _ray_counter, _ray_gauge)
        self._mirroring = asyncio.create_task(self._mirror_metrics())

    async def _mirror_metrics(self) -> None:
        while True:
            self.mirror.sync()
            await asyncio.sleep(METRICS_PERIOD_S)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's response to ``request``: its head, then its body as it is sent."""
        async for part in self.runner.call(request):
            yield part

    async def __del__(self) -> None:
        self._mirroring.cancel()
        await self.runner.stop()


def _ray_counter(name: str, description: str, tags: tuple[str, ...]) -> Any:
    from ray.serve.metrics import Counter

    return Counter(name, description, tag_keys=tags)


def _ray_gauge(name: str, description: str, tags: tuple[str, ...]) -> Any:
    from ray.serve.metrics import Gauge

    return Gauge(name, description, tag_keys=tags)


# -- the ingress -----------------------------------------------------------------------------------------
class OnnxgenIngress:
    """The HTTP front: guard, body, routing key, then the engine replica's response, relayed."""

    async def __init__(self, engine: DeploymentHandle, security: SecurityConfig, retries: int) -> None:
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
            client,  # type: ignore[arg-type]
            server,  # type: ignore[arg-type]
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
                yield chunk  # type: ignore[misc]
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
    return [chunk async for chunk in stream]  # type: ignore[misc]


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
        chunks.append(chunk)  # type: ignore[arg-type]
        if _carries_output(chunk):  # type: ignore[arg-type]
            break
    return chunks


# -- the application -------------------------------------------------------------------------------------
def build_app(
    model: str | EngineSpec,
    *,
    replicas: int = 2,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float | None = None,
    affinity_slack: int | None = None,
    ingress_replicas: int = 1,
    retries: int = 2,
    **engine: Any,
) -> serve.Application:
    """The Ray Serve application: ``replicas`` engines of ``model`` behind one OpenAI-compatible ingress.

    ``model`` is a model directory (present at that path on every node) or an :class:`EngineSpec`;
    ``engine`` takes :class:`EngineSpec`'s other fields (``threads`` defaults to 1 here: one replica per
    core). With ``min_replicas`` / ``max_replicas`` the engines autoscale between those counts on the
    requests in flight per replica (``target_ongoing_requests``, default ``max_batch``). The router keeps
    a request on the replica holding its prefix while that replica has at most ``affinity_slack``
    (default ``max_batch``) requests more than the least loaded one. A request whose replica fails
    before it answered is sent again up to ``retries`` times. Run it with ``serve.run(app)``.
    """
    spec = model if isinstance(model, EngineSpec) else EngineSpec(str(model), **{"threads": 1, **engine})
    if isinstance(model, EngineSpec) and engine:
        spec = replace(spec, **engine)
    spec.scheduler_config()  # bad sizes fail here, not in every replica
    scaling = _scaling(replicas, min_replicas, max_replicas, target_ongoing_requests or spec.max_batch)
    if retries < 0 or ingress_replicas < 1:
        raise ValueError(
            f"retries must be >= 0 and ingress_replicas >= 1 (got {retries}, {ingress_replicas})"
        )
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={"slack": spec.max_batch if affinity_slack is None else affinity_slack},
    )
    engines = serve.deployment(
        OnnxgenEngine,
        ray_actor_options={"num_cpus": spec.threads or 1},
        max_ongoing_requests=spec.max_batch + spec.max_queue,
        max_queued_requests=spec.max_queue,
        request_router_config=router,
        health_check_period_s=5.0,
        **scaling,
    )
    ingress = serve.deployment(
        serve.ingress()(OnnxgenIngress),
        name="OnnxgenIngress",
        num_replicas=ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
    )
    return ingress.bind(engines.bind(spec), spec.security, retries)


def _scaling(replicas: int, low: int | None, high: int | None, target: float) -> dict[str, Any]:
    if low is None and high is None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1 (got {replicas})")
        return {"num_replicas": replicas}
    low, high = low if low is not None else 1, high if high is not None else max(low or 1, replicas)
    if not 0 <= low <= high or high < 1:
        raise ValueError(
            f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1 (got {low}, {high}); fix the counts"
        )
    if target <= 0:
        raise ValueError(f"target_ongoing_requests must be > 0 (got {target})")
    config = {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": target}
    return {"num_replicas": "auto", "autoscaling_config": config}


def run_until_interrupted(
    app: serve.Application, host: str, port: int, address: str | None, say: Callable[[str], None]
) -> None:
    """Deploy ``app`` with Ray Serve's HTTP proxy on ``host:port`` (on a cluster at ``address``, else on a
    Ray instance started here) and keep it up until Ctrl-C, then take it down."""
    import ray

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # a terminated server takes its replicas (and a Ray it started) down too

    say(f"starting Ray ({address or 'a local instance'}) and the replicas")
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    signal.signal(signal.SIGTERM, stop)  # after ray.init, which sets its own
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        status = serve.status().applications[APP_NAME].deployments["OnnxgenEngine"]
        replicas = status.replica_states.get("RUNNING", 0)
        say(f"listening on http://{f'[{host}]' if ':' in host else host}:{port} ({replicas} engine replicas)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        if address is None:
            serve.shutdown()
        ray.shutdown()
