"""Load test of ``onnxgen serve``: throughput and latency percentiles at several concurrency levels.

Starts ``python -m onnxgen.cli.serve MODEL`` on 127.0.0.1 (loopback only), then for each level C runs C
closed-loop clients that send streaming greedy completions back to back (fixed prompt lengths, exactly
``--max-tokens`` new tokens each) until ``--requests`` requests are done or ``--level-timeout`` seconds
pass, and reports total generated tokens/s and per-request latency, time to first token and inter-token
latency percentiles. Level 1 is the sequential baseline (one request at a time through the same server).

With ``--genai`` the same load runs on onnxruntime-genai (scripts/load_genai.py: its Engine in process, no
HTTP, and padded static batches) over the same model and prompts, for comparison. With ``--step-scaling``
the batched decode step is also timed alone per batch size. With ``--ray-replicas 2x1,1x2`` the same load
also goes to ``onnxgen serve --ray --replicas N --threads T`` for each ``NxT`` given (Ray Serve replicas
behind one ingress; each starts its own local Ray instance). With ``--rounds R`` the whole sweep repeats
R times (levels and engines taking turns), and tokens/s is the median round: on a shared machine the load
of other jobs changes from minute to minute. With ``--trace FILE`` the onnxgen server writes its step trace
there (``ONNXGEN_STEP_TRACE``) and each level's wall time is split by ``scripts/serve_trace.py`` (decode
forwards by rows, prefill, copies, host work, idle). With ``--ab-flags FLAGS`` a second onnxgen server
runs with FLAGS added (e.g. ``--batch-prefill``), the two taking turns at each level (its trace, with
``--trace``, goes to FILE with ``.ab`` before the suffix). Every count and wait is bounded.

    python scripts/load_test.py /work/bench-models/qwen3_5-int4 --threads 2 --out load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

PROMPT_LENGTHS = (16, 32, 64, 128)
SERVE = "onnxgen serve"
SINGLE = "onnxgen serve, 1-row steps"  # --min-batch-rows 1: the fastest one-at-a-time baseline


@dataclass
class RequestTiming:
    latency_s: float
    ttft_s: float
    tokens: int

    @property
    def itl_s(self) -> float:
        return (self.latency_s - self.ttft_s) / max(self.tokens - 1, 1)


@dataclass
class LevelResult:
    engine: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    timings: list[RequestTiming] = field(repr=False, default_factory=list)
    span: tuple[float, float] = field(repr=False, default=(0.0, 0.0))  # Unix start and end

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def percentiles(self, what: str) -> tuple[float, float, float]:
        values = np.array([getattr(t, what) for t in self.timings]) * 1000.0
        p50, p90, p99 = np.percentile(values, [50, 90, 99]) if len(values) else (0.0, 0.0, 0.0)
        return float(p50), float(p90), float(p99)

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {k: v for k, v in asdict(self).items() if k not in ("timings", "span")}
        out["tokens_per_s"] = round(self.tokens_per_s, 1)
        for what in ("latency_s", "ttft_s", "itl_s"):
            out[what.replace("_s", "_ms") + "_p50_p90_p99"] = [round(v, 1) for v in self.percentiles(what)]
        return out


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (never the low special ids) in the fixed lengths, cycled."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]).tolist() for i in range(count)]


# -- onnxgen serve ----------------------------------------------------------------------------------------
class Server:
    def __init__(
        self,
        model: Path,
        threads: int,
        max_batch: int,
        log: Path,
        extra: Sequence[str] = (),
        trace: Path | None = None,
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = model.name
        cmd = [sys.executable, "-m", "onnxgen.cli.serve", str(model), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--threads", str(threads), "--max-batch", str(max_batch)]
        cmd += ["--max-queue", "256", *extra]
        self._log = log.open("wb")
        env = dict(os.environ, ONNXGEN_STEP_TRACE=str(trace)) if trace else None
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.close()
        raise SystemExit(f"the server did not start; see {log}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self._log.close()


async def _one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            got = len(chunk["choices"][0].get("token_ids", ())) if chunk["choices"] else 0
            if got and not tokens:
                first = time.perf_counter() - start
            tokens += got
    return RequestTiming(time.perf_counter() - start, first, tokens)


async def server_level(
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    concurrency: int,
    count: int,
    max_tokens: int,
    timeout: float,
) -> LevelResult:
    timings: list[RequestTiming] = []
    next_index = 0
    start, unix_start = time.perf_counter(), time.time()

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < count and time.perf_counter() - start < timeout:
            prompt = prompts[next_index % len(prompts)]
            next_index += 1
            timings.append(await _one_request(client, model, prompt, max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*[client_loop(client) for _ in range(concurrency)])
    wall = time.perf_counter() - start
    tokens = sum(t.tokens for t in timings)
    span = (unix_start, unix_start + wall)
    return LevelResult("onnxgen serve", concurrency, len(timings), tokens, wall, timings, span)


# -- decode steps alone -------------------------------------------------------------------------------------
def step_scaling(model: Path, threads: int, sizes: Sequence[int], steps: int = 15) -> list[tuple[int, float]]:
    """Median wall time of one batched decode step (BatchState.step) per batch size, sizes interleaved so
    that a busy machine slows them alike."""
    from onnxgen import load
    from onnxgen.runtime.batch import BatchState

    llm = load(model, threads=threads)
    rng = np.random.default_rng(0)
    prefill = llm.session.new_state(512)
    batches = {}
    for size in sizes:
        batch = BatchState(llm.session, size, 512)
        while batch.n < size:
            prefill.reset()
            llm.session.forward(prefill, rng.integers(3, llm.session.vocab_size, (1, 64)), 1)
            batch.admit(prefill)
        batches[size] = batch
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(steps):
        for size, batch in batches.items():
            start = time.perf_counter()
            batch.step(rng.integers(3, llm.session.vocab_size, size))
            times[size].append(time.perf_counter() - start)
    return [(size, float(np.median(times[size]))) for size in sizes]


def scaling_table(rows: Sequence[tuple[int, float]]) -> str:
    one = rows[0][0] / rows[0][1]
    lines = ["| rows | step ms (median) | tok/s | vs 1 row |", "|---:|---:|---:|---:|"]
    for size, seconds in rows:
        lines.append(
            f"| {size} | {seconds * 1000:.1f} | {size / seconds:.0f} | {size / seconds / one:.2f}x |"
        )
    return "\n".join(lines)


# -- report -------------------------------------------------------------------------------------------------
def merge(results: Sequence[LevelResult]) -> list[tuple[LevelResult, list[float]]]:
    """One pooled result per (engine, clients) over the rounds, with each round's tokens/s; the pooled
    result's wall time is chosen so that its tokens/s is the median round's."""
    groups: dict[tuple[str, int], list[LevelResult]] = {}
    for r in results:
        groups.setdefault((r.engine, r.concurrency), []).append(r)
    merged = []
    for (engine, clients), rounds in groups.items():
        rates = [r.tokens_per_s for r in rounds]
        tokens = sum(r.tokens for r in rounds)
        wall = tokens / float(np.median(rates)) if min(rates) > 0 else 0.0
        timings = [t for r in rounds for t in r.timings]
        merged.append((LevelResult(engine, clients, len(timings), tokens, wall, timings), rates))
    return merged


def table(results: Sequence[LevelResult]) -> str:
    merged = merge(results)
    base = {r.engine: r.tokens_per_s for r, _ in merged if r.concurrency == 1}
    base[SERVE] = base.get(SINGLE, base.get(SERVE, 0.0))  # onnxgen rows against the fastest sequential run
    lines = [
        "| engine | clients | requests | tok/s (median; rounds) | vs one at a time | latency p50/p90/p99 ms "
        "| TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms |",
        "|---|---:|---:|---|---:|---|---|---|",
    ]
    for r, rates in merged:
        ratio = r.tokens_per_s / base[r.engine] if base.get(r.engine) else float("nan")
        cells = [" / ".join(f"{v:.0f}" for v in r.percentiles(w)) for w in ("latency_s", "ttft_s", "itl_s")]
        spread = ", ".join(f"{v:.0f}" for v in rates)
        lines.append(
            f"| {r.engine} | {r.concurrency} | {r.requests} | {r.tokens_per_s:.0f} ({spread}) | {ratio:.2f}x | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="model directory")
    p.add_argument(
        "--concurrency", default="1,4,8,16", help="comma-separated client counts (default 1,4,8,16)"
    )
    p.add_argument(
        "--requests", type=int, default=0, help="requests per level (default: max(8, 2 x clients))"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of each engine (default 2)")
    p.add_argument("--level-timeout", type=float, default=180.0, help="stop issuing requests after this (s)")
    p.add_argument(
        "--genai",
        action="store_true",
        help="also run onnxruntime-genai (Engine, padded batch) on the same load",
    )
    p.add_argument("--no-serve", action="store_true", help="skip the onnxgen server levels")
    p.add_argument(
        "--serve-flags",
        default="",
        help="more flags for the onnxgen server, as one string (e.g. '--prefill-chunk 64')",
    )
    p.add_argument(
        "--ab-flags",
        help="also run a second onnxgen server with these flags added, as one string (e.g. "
        "'--batch-prefill'); the two take turns at each level",
    )
    p.add_argument(
        "--ray-replicas",
        default="",
        help="also run `onnxgen serve --ray` for each comma-separated REPLICASxTHREADS (e.g. 2x1,1x2; "
        "a bare N means N x 1 thread); Ray Serve, default: not",
    )
    p.add_argument(
        "--single-row-baseline",
        action="store_true",
        help="also run 1 client on a second server with --min-batch-rows 1 (the fastest sequential baseline)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat the sweep; tokens/s is the median round (default 1)"
    )
    p.add_argument("--step-scaling", action="store_true", help="also time batched decode steps alone")
    p.add_argument(
        "--trace", type=Path, help="the onnxgen server's step trace file; split each level's time by it"
    )
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def ray_configs(text: str) -> list[tuple[int, int]]:
    """(replicas, threads) of each ``NxT`` (or bare ``N``: one thread) in a comma-separated list."""
    configs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        replicas, _, threads = item.partition("x")
        try:
            configs.append((int(replicas), int(threads or 1)))
        except ValueError:
            raise SystemExit(f"--ray-replicas {item!r}: expected REPLICASxTHREADS such as 2x1") from None
    return configs


def print_trace(trace: Path, results: Sequence[LevelResult]) -> None:
    from serve_trace import report  # beside this script

    for r in results:
        print(
            f"\nwhere the server's time went, {r.concurrency} clients ({r.tokens} tokens, {r.wall_s:.1f} s):"
        )
        print(report(trace, *r.span, clients=r.concurrency))


def ab_label(args: argparse.Namespace) -> str:
    return f"{SERVE} {args.ab_flags}"


def ab_trace(args: argparse.Namespace) -> Path | None:
    """The ``--ab-flags`` server's step trace file (None: no ``--trace``)."""
    return args.trace.with_suffix(".ab" + args.trace.suffix) if args.trace else None


def log_path(args: argparse.Namespace) -> Path:
    return Path(args.out.with_suffix(".server.log") if args.out else "load_test.server.log")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = json.loads((args.model / "genai_config.json").read_text())["model"]["vocab_size"]
    prompts = make_prompts(64, vocab)
    results: list[LevelResult] = []
    servers: dict[str, Server] = {}
    genai = None
    try:
        if not args.no_serve:
            flags = tuple(shlex.split(args.serve_flags))
            if args.trace:
                args.trace.unlink(missing_ok=True)
            servers[SERVE] = Server(args.model, args.threads, max(levels), log_path(args), flags, args.trace)
            if args.single_row_baseline:
                flags = (*flags, "--min-batch-rows", "1")
                log = log_path(args).with_suffix(".single.log")
                servers[SINGLE] = Server(args.model, args.threads, max(levels), log, flags)
            if args.ab_flags is not None:
                ab = (*tuple(shlex.split(args.serve_flags)), *shlex.split(args.ab_flags))
                log, trace = log_path(args).with_suffix(".ab.log"), ab_trace(args)
                if trace:
                    trace.unlink(missing_ok=True)
                servers[ab_label(args)] = Server(args.model, args.threads, max(levels), log, ab, trace)
        for replicas, threads in ray_configs(args.ray_replicas):
            label = f"onnxgen serve --ray, {replicas} x {threads} thread"
            flags = ("--ray", "--replicas", str(replicas))
            log = log_path(args).with_suffix(f".ray{replicas}x{threads}.log")
            servers[label] = Server(args.model, threads, max(levels), log, flags)
        for server in servers.values():
            asyncio.run(server_level(server.url, server.name, prompts[:2], 1, 2, 8, 60))  # warm-up
        if args.genai:
            from load_genai import GenaiRunner  # beside this script

            genai = GenaiRunner(args, prompts)
        for c in [c for _ in range(args.rounds) for c in levels]:  # engines and levels take turns
            for label, server in servers.items():
                if label == SINGLE and c != 1:
                    continue
                count = args.requests or max(8, 2 * c)
                level = server_level(
                    server.url, server.name, prompts, c, count, args.max_tokens, args.level_timeout
                )
                results.append(asyncio.run(level))
                results[-1].engine = label
                print(json.dumps(results[-1].summary()), flush=True)
            if genai is not None:
                results += genai.level(c)
    finally:
        for server in servers.values():
            server.close()
    notes = genai.notes if genai is not None else []
    order = {engine: i for i, engine in enumerate(dict.fromkeys(r.engine for r in results))}
    results.sort(key=lambda r: (order[r.engine], r.concurrency))  # stable: rounds stay in order
    print(table(results))
    if args.trace:
        print_trace(args.trace, [r for r in results if r.engine == SERVE])
        ab = ab_trace(args)
        if ab:
            print(f"\n{ab_label(args)}:")
            print_trace(ab, [r for r in results if r.engine == ab_label(args)])
    notes = list(dict.fromkeys(notes))  # one line per finding, not per round
    print("\n".join(notes))
    report: dict[str, object] = {
        "model": str(args.model),
        "levels": [r.summary() for r in results],
        "notes": notes,
    }
    if args.step_scaling:
        rows = step_scaling(args.model, args.threads, [1, 2, 4, 8, 16])
        print(scaling_table(rows))
        report["step_scaling"] = rows
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
