"""Mirroring an engine's prometheus registry into another metrics system (Ray's, on a replica)."""

from __future__ import annotations

from onnxgen.server.metrics import ServerMetrics
from onnxgen.serving.metrics import RegistryMirror


class Recorder:
    """A stand-in for Ray's Counter / Gauge that records what it is sent."""

    made: dict[str, Recorder] = {}  # noqa: RUF012

    def __init__(self, name: str, description: str, tags: tuple[str, ...]) -> None:
        self.name, self.tags = name, tags
        self.sent: list[tuple[float, dict[str, str]]] = []
        Recorder.made[name] = self

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.sent.append((value, dict(tags or {})))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.sent.append((value, dict(tags or {})))


def test_counters_go_as_increases_gauges_as_values_and_histograms_as_bucket_counters() -> None:
    Recorder.made = {}
    metrics = ServerMetrics()
    mirror = RegistryMirror(metrics.registry, Recorder, Recorder)
    metrics.generation_tokens.inc(5)
    metrics.finished.labels("stop").inc()
    metrics.queue_depth.set(3)
    metrics.ttft.observe(0.02)
    mirror.sync()
    made = Recorder.made
    assert made["onnxgen_generation_tokens"].sent == [(5.0, {})]
    assert made["onnxgen_sequences_finished"].sent == [(1.0, {"reason": "stop"})]
    assert made["onnxgen_sequences_finished"].tags == ("reason",)
    assert made["onnxgen_queue_depth"].sent == [(3.0, {})]
    buckets = dict(
        (tags["le"], value) for value, tags in made["onnxgen_time_to_first_token_seconds_bucket"].sent
    )
    assert "0.01" not in buckets and buckets["0.025"] == 1.0 and buckets["+Inf"] == 1.0
    assert made["onnxgen_time_to_first_token_seconds_sum"].sent == [(0.02, {})]

    metrics.generation_tokens.inc(2)
    metrics.queue_depth.set(0)
    mirror.sync()  # only what changed since: 2 more tokens, the new depth, nothing for unchanged series
    assert made["onnxgen_generation_tokens"].sent[1:] == [(2.0, {})]
    assert made["onnxgen_queue_depth"].sent[1:] == [(0.0, {})]
    assert len(made["onnxgen_sequences_finished"].sent) == 1
    assert not any(name.endswith("_created") for name in made)
