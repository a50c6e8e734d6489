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
- ``OnnxgenIngress`` (:mod:`onnxgen.serving.ray_ingress`): checks Host / Origin / API key like the engine
  does, reads the body (same limits), keys it by its prompt's leading parts
  (:mod:`onnxgen.serving.affinity`) and passes it on through a handle whose router,
  :class:`~onnxgen.serving.ray_router.PrefixAffinityRouter`, prefers the replica that holds the prefix.
  A request whose replica dies before any output reached the client is sent again to another replica;
  a stream cut later ends with an error event. ``/metrics`` here shows the ingress's own counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import fields, replace
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from onnxgen.server.security import SecurityConfig
from onnxgen.serving.asgi import AppRunner, ForwardedRequest, ResponseHead
from onnxgen.serving.engine import EngineSpec, load_app
from onnxgen.serving.metrics import RegistryMirror
from onnxgen.serving.ray_ingress import REPLICA_HEADER, OnnxgenIngress
from onnxgen.serving.ray_router import PrefixAffinityRouter

__all__ = [
    "REPLICA_HEADER",
    "OnnxgenEngine",
    "OnnxgenIngress",
    "PrefixAffinityRouter",
    "app_builder",
    "build_app",
]

APP_NAME = "onnxgen"
METRICS_PERIOD_S = 5.0


# -- the engine replicas ---------------------------------------------------------------------------------
class OnnxgenEngine:
    """One engine replica: the ``onnxgen serve`` app, driven in process."""

    async def __init__(self, spec: EngineSpec) -> None:  # type: ignore[misc]  # Ray Serve awaits it
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
    scaling = scaling_options(replicas, min_replicas, max_replicas, target_ongoing_requests or spec.max_batch)
    if retries < 0 or ingress_replicas < 1:
        raise ValueError(
            f"retries must be >= 0 and ingress_replicas >= 1 (got {retries}, {ingress_replicas})"
        )
    engines = engine_deployment(spec, scaling, spec.max_batch if affinity_slack is None else affinity_slack)
    ingress = serve.deployment(
        serve.ingress()(OnnxgenIngress),
        name="OnnxgenIngress",
        num_replicas=ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
    )
    return ingress.bind(engines.bind(spec), spec.security, retries)


_APP_ARGS: tuple[str, ...] = (
    "replicas",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "affinity_slack",
)
_APP_ARGS += ("ingress_replicas", "retries")
_INTEGERS = ("replicas", "min_replicas", "max_replicas", "affinity_slack", "ingress_replicas", "retries")
_ENGINE_INTEGERS = ("threads", "max_batch", "max_queue", "max_model_len", "prefill_chunk", "min_rows")


def app_builder(args: dict[str, Any]) -> serve.Application:
    """:func:`build_app` from a Ray Serve config's ``args`` (``serve run onnxgen.serving.ray:app_builder
    model=/models/qwen3 replicas=4``, or a KubeRay RayService's ``serveConfigV2``): numbers may come as
    text; ``security`` is a mapping of :class:`SecurityConfig`'s fields (``api_key``, ``host``, ...)."""
    options = dict(args)
    if "model" not in options:
        raise ValueError("the application needs args.model: the model directory on every node")
    _check_names("args", options, _APP_ARGS + tuple(f.name for f in fields(EngineSpec)))
    for name in _INTEGERS + _ENGINE_INTEGERS:
        if options.get(name) is not None:
            options[name] = int(options[name])
    if "target_ongoing_requests" in options:
        options["target_ongoing_requests"] = float(options["target_ongoing_requests"])
    security = dict(options.pop("security", None) or {})
    _check_names("args.security", security, tuple(f.name for f in fields(SecurityConfig)))
    for name in ("allowed_hosts", "cors_origins"):
        if isinstance(security.get(name), str):
            security[name] = tuple(n.strip() for n in security[name].split(",") if n.strip())
        elif name in security:
            security[name] = tuple(security[name])
    return build_app(options.pop("model"), security=SecurityConfig(**security), **options)


def _check_names(where: str, given: dict[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"unknown {where} {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def engine_deployment(spec: EngineSpec, scaling: dict[str, Any], slack: int) -> serve.Deployment:
    """The engine deployment: one core per thread, at most the engine's rows and queue in flight per
    replica, at most one engine queue's worth waiting at each caller (then 503), prefix-aware routing."""
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter, request_router_kwargs={"slack": slack}
    )
    return serve.deployment(
        OnnxgenEngine,
        ray_actor_options={"num_cpus": spec.threads or 1},
        max_ongoing_requests=spec.max_batch + spec.max_queue,
        max_queued_requests=spec.max_queue,
        request_router_config=router,
        health_check_period_s=5.0,
        **scaling,
    )


def scaling_options(replicas: int, low: int | None, high: int | None, target: float) -> dict[str, Any]:
    """``num_replicas`` (fixed) or Ray Serve's autoscaling between ``low`` and ``high`` replicas on
    ``target`` requests in flight per replica."""
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
    if address is None:
        # Ray runs its workers at niceness 15 by default; here the workers are the server itself
        os.environ.setdefault("RAY_worker_niceness", "0")
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
