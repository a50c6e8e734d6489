"""Metrics of a deployment: the ingress's own, and each engine's mirrored into another metrics system.

An engine keeps its metrics in a prometheus_client registry (what ``onnxgen serve`` shows on
/metrics). On Ray, :class:`RegistryMirror` copies that registry into Ray's metrics every few seconds,
where Ray tags each series with its replica and exports them with the cluster's metrics: counters by
their increase, gauges by their value, and histograms as counters of their ``_bucket`` (tagged ``le``),
``_count`` and ``_sum`` series, so rates, means and quantiles still come out of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

# (name, description, tag keys) -> a metric with ``inc(value, tags=)`` (counters) or ``set(value, tags=)``
MetricFactory = Callable[[str, str, tuple[str, ...]], Any]


class RegistryMirror:
    """Copies the samples of a prometheus_client registry into counters and gauges made by factories
    (Ray's: ``ray.serve.metrics.Counter`` / ``Gauge``), each :meth:`sync` sending what changed since."""

    def __init__(self, registry: CollectorRegistry, counter: MetricFactory, gauge: MetricFactory) -> None:
        self.registry = registry
        self._factories = {"counter": counter, "gauge": gauge}
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def _metric(self, kind: str, name: str, description: str, tags: tuple[str, ...]) -> Any:
        if name not in self._metrics:
            self._metrics[name] = self._factories[kind](name, description, tags)
        return self._metrics[name]

    def sync(self) -> None:
        for family in self.registry.collect():
            if family.type not in ("counter", "gauge", "histogram"):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                tags = dict(sample.labels)
                keys = tuple(sorted(tags))
                if family.type == "gauge":
                    gauge = self._metric("gauge", sample.name, family.documentation, keys)
                    gauge.set(sample.value, tags=tags)
                    continue
                name = sample.name.removesuffix("_total")
                seen = (name, tuple(sorted(tags.items())))
                delta = sample.value - self._last.get(seen, 0.0)
                self._last[seen] = sample.value
                if delta > 0:
                    counter = self._metric("counter", name, family.documentation, keys)
                    counter.inc(delta, tags=tags)


class IngressMetrics:
    """What the ingress counts: HTTP requests by endpoint and status, and how each was routed."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "onnxgen_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.routed = Counter(
            "onnxgen_routed_requests",
            "requests by the replica that answered and how the router chose it (held, prefix: a prefix "
            "hit; anchor, overloaded, unkeyed: not)",
            ["replica", "how"],
            registry=r,
        )
        self.retries = Counter(
            "onnxgen_retried_requests",
            "requests sent again after their replica failed before any output",
            registry=r,
        )
        self.broken = Counter(
            "onnxgen_broken_responses",
            "responses cut short because their replica failed mid-stream",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
