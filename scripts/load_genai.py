"""The onnxruntime-genai side of scripts/load_test.py: the same closed-loop load on its two batching modes.

- the Engine (in process, no HTTP) with its static batch scheduler, up to as many rows as clients;
- a padded batch: waves of prompts right-padded into one ``GeneratorParams(batch_size=B)`` generator (the
  only layout whose pad positions GroupQueryAttention skips), also checked row by row against each prompt
  generated alone.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from load_test import LevelResult, RequestTiming


# -- onnxruntime-genai Engine -------------------------------------------------------------------------------
def genai_level(
    model: Path,
    threads: int,
    prompts: Sequence[list[int]],
    concurrency: int,
    count: int,
    max_tokens: int,
    timeout: float,
) -> LevelResult:
    import onnxruntime_genai as og

    engine = og.Engine(_genai_model(model, threads, concurrency))
    buffer = engine.create_event_buffer(1024)
    in_flight: dict[int, tuple[object, float, list[float]]] = {}
    timings: list[RequestTiming] = []
    submitted = 0
    start = time.perf_counter()

    def submit() -> None:
        nonlocal submitted
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(max_tokens)
        options.set_min_generated_tokens(max_tokens)
        request.begin_turn(np.asarray(prompts[submitted % len(prompts)], dtype=np.int32), options)
        in_flight[id(request)] = (request, time.perf_counter(), [])
        submitted += 1

    while submitted < min(concurrency, count):
        submit()
    finished = og.EngineEventFlags.TURN_FINISHED.value
    while in_flight:
        for event in engine.run(buffer):
            request, t0, stamps = in_flight[id(event.request)]
            stamps.append(time.perf_counter())
            if int(event.flags.value) & finished:
                del in_flight[id(request)]
                request.close()  # type: ignore[attr-defined]
                timings.append(RequestTiming(stamps[-1] - t0, stamps[0] - t0, len(stamps)))
                if submitted < count and time.perf_counter() - start < timeout:
                    submit()
    wall = time.perf_counter() - start
    return LevelResult(
        "onnxruntime-genai Engine", concurrency, len(timings), sum(t.tokens for t in timings), wall, timings
    )


def _genai_model(model: Path, threads: int, max_batch: int) -> object:
    import onnxruntime_genai as og

    config = og.Config(str(model))
    config.clear_providers()
    overlay = {
        "model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}},
        "engine": {"static_batching": {"max_batch_size": max(max_batch, 1)}},
    }
    config.overlay(json.dumps(overlay))
    return og.Model(config)


def _genai_generate(
    og: object, model: object, rows: Sequence[list[int]], max_tokens: int
) -> tuple[list[list[int]], float]:
    """One onnxruntime-genai Generator over ``rows`` right-padded into one [B, P] batch (pad id 0, the
    builder's pad token); exactly ``max_tokens`` new tokens per row. Returns the new tokens and TTFT."""
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    params = og.GeneratorParams(model)  # type: ignore[attr-defined]
    total = width + max_tokens
    params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=len(rows))
    generator = og.Generator(model, params)  # type: ignore[attr-defined]
    start = time.perf_counter()
    generator.append_tokens(ids)
    generator.generate_next_token()
    ttft = time.perf_counter() - start
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(i)[width:]] for i in range(len(rows))], ttft


def genai_padded_level(
    model: Path,
    threads: int,
    prompts: Sequence[list[int]],
    concurrency: int,
    count: int,
    max_tokens: int,
    timeout: float,
) -> tuple[LevelResult, str]:
    """onnxruntime-genai's static batching: waves of ``concurrency`` prompts, right-padded into one batch.
    Also returns how many rows of the first wave equal the same prompt generated alone."""
    import onnxruntime_genai as og

    m = _genai_model(model, threads, concurrency)
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    first_wave: list[list[int]] = []
    done = 0
    while done < count and time.perf_counter() - start < timeout:
        rows = [prompts[(done + i) % len(prompts)] for i in range(min(concurrency, count - done))]
        t0 = time.perf_counter()
        out, ttft = _genai_generate(og, m, rows, max_tokens)
        latency = time.perf_counter() - t0
        timings += [RequestTiming(latency, ttft, max_tokens) for _ in rows]
        first_wave = first_wave or out
        done += len(rows)
    wall = time.perf_counter() - start
    alone = [_genai_generate(og, m, [prompts[i]], max_tokens)[0][0] for i in range(len(first_wave))]
    same = sum(a == b for a, b in zip(alone, first_wave, strict=True))
    result = LevelResult(
        "onnxruntime-genai padded batch", concurrency, len(timings), len(timings) * max_tokens, wall, timings
    )
    return result, f"{same}/{len(first_wave)}"


class GenaiRunner:
    """Both onnxruntime-genai batching modes, one level at a time (interleaved with the server's levels so
    that a busy machine slows both alike); a mode that fails is reported once and skipped from then on."""

    def __init__(self, args: argparse.Namespace, prompts: Sequence[list[int]]) -> None:
        self.args = args
        self.prompts = prompts
        self.notes: list[str] = []
        self.failed: set[str] = set()

    def level(self, c: int) -> list[LevelResult]:
        a = self.args
        count = a.requests or max(8, 2 * c)
        out = []
        if "engine" not in self.failed:
            try:
                out.append(
                    genai_level(a.model, a.threads, self.prompts, c, count, a.max_tokens, a.level_timeout)
                )
            except Exception as e:  # onnxruntime-genai refuses some exports
                self.failed.add("engine")
                self.notes.append(f"onnxruntime-genai Engine failed at {c} clients: {e}")
        if "padded" not in self.failed:
            try:
                result, same = genai_padded_level(
                    a.model, a.threads, self.prompts, c, count, a.max_tokens, a.level_timeout
                )
                out.append(result)
                self.notes.append(
                    f"onnxruntime-genai padded batch of {c}: {same} rows of the first batch equal the prompt run alone"
                )
            except Exception as e:
                self.failed.add("padded")
                self.notes.append(f"onnxruntime-genai padded batch failed at {c} rows: {e}")
        for result in out:
            print(json.dumps(result.summary()), flush=True)
        return out
