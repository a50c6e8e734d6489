"""Benchmark harness: greedy generation timed in one worker process per engine.

Each engine (onnxgen, and with ``compare`` onnxruntime-genai) runs in its own subprocess, so peak RSS
is per engine, with the same intra-op thread count. The parent sends JSON-line commands on the
worker's stdin and reads one JSON line per reply; with two engines the runs are interleaved (onnxgen
run 1, genai run 1, onnxgen run 2, ...) so slow drifts of a shared machine hit both alike. A fresh
pair of workers serves each prompt length, so its peak RSS belongs to that length.

Per run: ``prefill_ms`` (the prefill forward alone), ``ttft_ms`` (request call to first token),
``step_ms`` (one entry per later token: a decode forward plus token selection), ``token_ids``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.bench_genai import GENAI, BenchError, GenaiEngine, require_genai, step_durations_ms
from onnxgen.bench_worker import Worker, machine_info, serve
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import load

ONNXGEN = "onnxgen"
ENGINES = (ONNXGEN, GENAI)

__all__ = [
    "ENGINES",
    "BenchConfig",
    "BenchError",
    "decode_rate",
    "run_bench",
    "synthetic_prompt",
    "worker_main",
]


@dataclass(frozen=True)
class BenchConfig:
    model: str
    prompt_tokens: tuple[int, ...] = (16, 512)
    new_tokens: int = 128
    warmups: int = 1
    runs: int = 5
    decode_skip: int = 0
    threads: int = 1
    compare: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise ValueError(f"--prompt-tokens must be positive integers (got {list(self.prompt_tokens)})")
        if self.new_tokens < 2:
            raise ValueError(
                f"--new-tokens must be >= 2 so there is a decode step to time (got {self.new_tokens})"
            )
        if self.runs < 1 or self.warmups < 0:
            raise ValueError(f"--runs must be >= 1 and --warmups >= 0 (got {self.runs}, {self.warmups})")
        if not 0 <= self.decode_skip < self.new_tokens - 1:
            raise ValueError(
                f"--decode-skip must be in [0, new_tokens - 1) = [0, {self.new_tokens - 1}) (got {self.decode_skip}); "
                "it drops that many of the new_tokens - 1 decode steps"
            )
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1 (got {self.threads})")
        if self.compare not in (None, GENAI):
            raise ValueError(f"--compare must be {GENAI!r} (got {self.compare!r})")


def synthetic_prompt(length: int, vocab_size: int) -> list[int]:
    """``length`` deterministic token ids spread over [1, vocab_size) (a fixed stride, no randomness)."""
    span = max(vocab_size - 1, 1)
    return [1 + (i * 7919 + 13) % span for i in range(length)]


def decode_rate(step_ms: Sequence[float], skip: int = 0) -> float:
    """Decode tokens per second over the steps after the first ``skip``."""
    steps = step_ms[skip:]
    total = sum(steps)
    return 1000.0 * len(steps) / total if total > 0 else 0.0


# -- worker side ----------------------------------------------------------------------------------
class OnnxgenEngine:
    """onnxgen's :class:`~onnxgen.llm.LLM`, driven through its stream; forwards are timed by wrapping
    the session's ``forward`` (so prefill is the first forward alone)."""

    name = ONNXGEN

    def __init__(self, model_dir: str | Path, threads: int) -> None:
        self.llm = load(model_dir, threads=threads)
        self._forward_ms: list[float] = []
        session = self.llm.session
        inner = session.forward

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self._forward_ms.append(1000.0 * (time.perf_counter() - t0))
            return out

        session.forward = timed_forward  # type: ignore[method-assign]

    def info(self) -> dict[str, Any]:
        from onnxgen import __version__

        vocab = self.llm.session.vocab_size
        if vocab <= 0 and self.llm.tokenizer is not None:
            vocab = self.llm.tokenizer.vocab_size
        return {
            "version": __version__,
            "vocab_size": vocab,
            "context_length": self.llm.package.context_length,
        }

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        # min_new_tokens = max_new_tokens masks end-of-sequence at every step, as onnxruntime-genai's
        # min_length does, so both engines pick the same greedy tokens (ignore_eos would not mask it).
        params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0)
        self._forward_ms.clear()
        ids: list[int] = []
        stamps: list[float] = []
        start = time.perf_counter()
        for event in self.llm.stream(list(prompt), params):
            stamps.append(time.perf_counter())
            ids.extend(event.token_ids)
        return {
            "prefill_ms": self._forward_ms[0],
            "ttft_ms": 1000.0 * (stamps[0] - start),
            "step_ms": step_durations_ms(stamps),
            "token_ids": ids,
        }


def make_engine(name: str, model: str, threads: int) -> OnnxgenEngine | GenaiEngine:
    if name == ONNXGEN:
        return OnnxgenEngine(model, threads)
    if name == GENAI:
        return GenaiEngine(model, threads)
    raise BenchError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a benchmark worker subprocess (see :mod:`onnxgen.bench_worker`)."""
    return serve(make_engine, argv)


# -- parent side ----------------------------------------------------------------------------------
def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: Sequence[dict[str, Any]], skip: int, info: dict[str, Any]) -> dict[str, Any]:
    """Median/min/max of prefill, TTFT and decode rate over the measured runs, plus the worker's facts."""
    rates = [decode_rate(r["step_ms"], skip) for r in runs]
    return {
        "prefill_ms": _spread([r["prefill_ms"] for r in runs]),
        "ttft_ms": _spread([r["ttft_ms"] for r in runs]),
        "decode_tok_s": _spread(rates),
        "peak_rss_mb": runs[-1]["peak_rss_mb"],
        "process_threads": info.get("process_threads"),
        "version": info.get("version"),
        "runs": [
            {"prefill_ms": r["prefill_ms"], "ttft_ms": r["ttft_ms"], "decode_tok_s": rate}
            for r, rate in zip(runs, rates, strict=True)
        ],
    }


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _comparison(engines: dict[str, dict[str, Any]], tokens: dict[str, list[int]]) -> dict[str, Any]:
    ours, theirs = engines[ONNXGEN], engines[GENAI]

    def ratio(key: str) -> float:
        base = theirs[key]["median"]
        return ours[key]["median"] / base if base > 0 else float("nan")

    divergence = _first_divergence(tokens[ONNXGEN], tokens[GENAI])
    return {
        "ratio": {
            "decode_tok_s": ratio("decode_tok_s"),
            "ttft": ratio("ttft_ms"),
            "prefill": ratio("prefill_ms"),
        },
        "tokens_match": divergence is None,
        "first_divergence": divergence,
    }


def _log_progress(
    log: Callable[[str], None], length: int, i: int, cfg: BenchConfig, runs: dict[str, list[dict[str, Any]]]
) -> None:
    if i < cfg.warmups:
        log(f"prompt {length}: warmup {i + 1}/{cfg.warmups}")
        return
    rates = ", ".join(
        f"{name} {decode_rate(r[-1]['step_ms'], cfg.decode_skip):.1f} tok/s" for name, r in runs.items()
    )
    log(f"prompt {length}: run {i + 1 - cfg.warmups}/{cfg.runs}: {rates}")


def _bench_length(cfg: BenchConfig, length: int, log: Callable[[str], None]) -> dict[str, Any]:
    names = [ONNXGEN] + ([GENAI] if cfg.compare else [])
    workers: list[Worker] = []
    try:
        for name in names:
            workers.append(Worker(name, cfg.model, cfg.threads))
        ref = workers[0].info
        context = ref.get("context_length")
        if context is not None and length + cfg.new_tokens > context:
            raise BenchError(
                f"--prompt-tokens {length} plus --new-tokens {cfg.new_tokens} exceeds the model's context of "
                f"{context} tokens; lower one of them"
            )
        prompt = synthetic_prompt(length, int(ref["vocab_size"]))
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for i in range(cfg.warmups + cfg.runs):
            for worker in workers:
                result = worker.run(prompt, cfg.new_tokens)
                if len(result["token_ids"]) != cfg.new_tokens:
                    raise BenchError(
                        f"{worker.engine} generated {len(result['token_ids'])} tokens, not {cfg.new_tokens}"
                    )
                if i >= cfg.warmups:
                    runs[worker.engine].append(result)
            _log_progress(log, length, i, cfg, runs)
        engines = {w.engine: summarize(runs[w.engine], cfg.decode_skip, w.info) for w in workers}
    finally:
        for worker in workers:
            worker.close()
    entry: dict[str, Any] = {"prompt_tokens": length, "engines": engines}
    if cfg.compare:
        entry.update(_comparison(engines, {n: runs[n][0]["token_ids"] for n in names}))
    return entry


def _stderr_log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = _stderr_log) -> dict[str, Any]:
    """Run the benchmark described by ``cfg``; return the JSON-ready report."""
    if cfg.compare:
        require_genai()
    machine = machine_info()
    results = [_bench_length(cfg, length, log) for length in cfg.prompt_tokens]
    machine["loadavg_end"] = list(os.getloadavg())
    return {
        "model": str(cfg.model),
        "threads": cfg.threads,
        "new_tokens": cfg.new_tokens,
        "warmups": cfg.warmups,
        "runs": cfg.runs,
        "decode_skip": cfg.decode_skip,
        "compare": cfg.compare,
        "machine": machine,
        "results": results,
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
