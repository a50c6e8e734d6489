"""Prometheus metrics of one server (own registry, so several apps can live in one process).

Two families: ``onnxgen_*`` (requests by endpoint and status, batch sizes, step times, rows), and the
names vLLM exports (``vllm:*``, labelled ``model_name``), which dashboards, autoscalers and the
Kubernetes Gateway API Inference Extension read from any model server: requests waiting and running,
the share of the KV cache (here: of the batch rows, each of which holds a whole sequence's cache) in use,
token counters, and time-to-first-token, inter-token and end-to-end latency histograms.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from onnxgen.cache.prefix import PrefixCache

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class _Metric(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Both:
    """Updates an ``onnxgen_*`` metric and its ``vllm:*`` twin together."""

    def __init__(self, *metrics: Any) -> None:
        self.metrics = metrics

    def inc(self, amount: float = 1) -> None:
        for metric in self.metrics:
            metric.inc(amount)

    def set(self, value: float) -> None:
        for metric in self.metrics:
            metric.set(value)

    def observe(self, value: float) -> None:
        for metric in self.metrics:
            metric.observe(value)


class ServerMetrics:
    """Requests, tokens, queue depth, batch sizes, time to first token and per-token latency."""

    def __init__(self, model_name: str = "model", max_batch: int = 1) -> None:
        self.registry = r = CollectorRegistry()
        self.max_batch = max_batch
        model = ["model_name"]

        def vllm_counter(name: str, doc: str) -> Any:
            return Counter(f"vllm:{name}", doc, model, registry=r).labels(model_name)

        def vllm_gauge(name: str, doc: str) -> Any:
            return Gauge(f"vllm:{name}", doc, model, registry=r).labels(model_name)

        def vllm_histogram(name: str, doc: str) -> Any:
            return Histogram(f"vllm:{name}", doc, model, buckets=LATENCY_BUCKETS, registry=r).labels(
                model_name
            )

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.requests = Counter(
            "onnxgen_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        finished = Counter(
            "onnxgen_sequences_finished",
            "choices that ended, by reason (stop, length, cancelled, error)",
            ["reason"],
            registry=r,
        )
        success = Counter(
            "vllm:request_success",
            "choices that ended, by finish reason",
            [*model, "finished_reason"],
            registry=r,
        )
        self.finished = _Finished(finished, success, model_name)
        self.prompt_tokens = Both(
            Counter("onnxgen_prompt_tokens", "prompt tokens prefilled", registry=r),
            vllm_counter("prompt_tokens", "prompt tokens prefilled"),
        )
        self.generation_tokens = Both(
            Counter("onnxgen_generation_tokens", "tokens generated", registry=r),
            vllm_counter("generation_tokens", "tokens generated"),
        )
        self.queue_depth = Both(
            Gauge("onnxgen_queue_depth", "prompts waiting for a batch row", registry=r),
            vllm_gauge("num_requests_waiting", "prompts waiting for a batch row"),
        )
        self.running = Both(
            Gauge("onnxgen_running_sequences", "batch rows decoding now", registry=r),
            vllm_gauge("num_requests_running", "sequences decoding now (one batch row each)"),
        )
        self.free_rows = Gauge("onnxgen_free_batch_rows", "batch rows free for new sequences", registry=r)
        self.kv_usage = vllm_gauge(
            "kv_cache_usage_perc", "share of the KV cache in use, 0 to 1 (batch rows in use / all rows)"
        )
        self.batch_size = histogram("onnxgen_batch_size", "rows per batched decode step", BATCH_BUCKETS)
        self.step_seconds = histogram("onnxgen_decode_step_seconds", "wall time of one batched decode step")
        self.speculative_yields = Counter(
            "onnxgen_speculative_yields",
            "greedy speculative sequences moved into (or started in) batch rows while plain rows decoded",
            registry=r,
        )
        self.speculative_resumes = Counter(
            "onnxgen_speculative_resumes",
            "speculative sequences moved from batch rows back into their lanes (no plain rows left)",
            registry=r,
        )
        self.ttft = Both(
            histogram("onnxgen_time_to_first_token_seconds", "arrival to first token, per choice"),
            vllm_histogram("time_to_first_token_seconds", "arrival to first token, per choice"),
        )
        self.per_token = Both(
            histogram(
                "onnxgen_time_per_output_token_seconds", "time between consecutive tokens of one choice"
            ),
            vllm_histogram("inter_token_latency_seconds", "time between consecutive tokens of one choice"),
        )
        self.e2e = Both(
            histogram("onnxgen_request_seconds", "arrival to last token, per choice"),
            vllm_histogram("e2e_request_latency_seconds", "arrival to last token, per choice"),
        )
        self.free_rows.set(max_batch)

    def rows(self, running: int, free: int) -> None:
        """The batch rows in use and free (after each scheduler iteration)."""
        self.running.set(running)
        self.free_rows.set(free)
        self.kv_usage.set((self.max_batch - free) / self.max_batch if self.max_batch else 0.0)

    def watch_prefix_cache(self, cache: PrefixCache) -> None:
        """Export the prefix cache's counters (read at each scrape)."""
        self.registry.register(_PrefixCacheCollector(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Finished:
    """``finished.labels(reason).inc()``: both counters, cancellations not counted as successes."""

    def __init__(self, finished: Counter, success: Counter, model_name: str) -> None:
        self.finished, self.success, self.model_name = finished, success, model_name

    def labels(self, reason: str) -> _Metric:
        if reason in ("stop", "length"):
            return Both(self.finished.labels(reason), self.success.labels(self.model_name, reason))
        return self.finished.labels(reason)

    def collect(self) -> Iterable[Metric]:
        """The finished-requests counter's samples (as ``Counter.collect``)."""
        return self.finished.collect()


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
