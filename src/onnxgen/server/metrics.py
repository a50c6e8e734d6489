"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from onnxgen.cache.prefix import PrefixCache

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class ServerMetrics:
    """Requests, tokens, queue depth, batch sizes, time to first token and per-token latency."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "onnxgen_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "onnxgen_sequences_finished",
            "choices that ended, by reason (stop, length, cancelled, error)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("onnxgen_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("onnxgen_generation_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("onnxgen_queue_depth", "prompts waiting for a batch row", registry=r)
        self.running = Gauge("onnxgen_running_sequences", "batch rows decoding now", registry=r)
        self.free_rows = Gauge("onnxgen_free_batch_rows", "batch rows free for new sequences", registry=r)
        self.batch_size = Histogram(
            "onnxgen_batch_size", "rows per batched decode step", buckets=BATCH_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            "onnxgen_decode_step_seconds",
            "wall time of one batched decode step",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "onnxgen_time_to_first_token_seconds",
            "arrival to first token, per choice",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            "onnxgen_time_per_output_token_seconds",
            "time between consecutive tokens of one choice",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "onnxgen_request_seconds",
            "arrival to last token, per choice",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def watch_prefix_cache(self, cache: PrefixCache) -> None:
        """Export the prefix cache's counters (read at each scrape)."""
        self.registry.register(_PrefixCacheCollector(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCollector(Collector):
    """The prefix cache's counters, named as vLLM names them where it has them (``prefix_cache_queries``,
    ``prefix_cache_hits``: prompt tokens looked up and tokens found)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        s = self.cache.stats()
        yield CounterMetricFamily(
            "onnxgen_prefix_cache_queries", "prompt tokens looked up in the prefix cache", value=s.queries
        )
        yield CounterMetricFamily(
            "onnxgen_prefix_cache_hits",
            "prompt tokens resumed from the prefix cache (not prefilled)",
            value=s.hits,
        )
        yield CounterMetricFamily(
            "onnxgen_prefix_cache_evictions",
            "prefix cache nodes evicted to stay within the budget",
            value=s.evictions,
        )
        yield GaugeMetricFamily("onnxgen_prefix_cache_bytes", "bytes the prefix cache holds", value=s.bytes)
        yield GaugeMetricFamily(
            "onnxgen_prefix_cache_budget_bytes", "the prefix cache's budget", value=s.budget
        )
