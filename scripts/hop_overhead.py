"""What the Ray Serve hop adds per request: ``onnxgen serve`` against ``onnxgen serve --ray --replicas 1``.

Starts both servers on 127.0.0.1 with the same model and threads (scripts/load_test.py's ``Server``), then
sends, one at a time and alternating between the two servers so that a busy machine slows both alike:
``GET /v1/models`` (answered by the engine's app without the model: the hop alone), ``GET /metrics`` (on
Ray answered by the ingress, so only Ray Serve's HTTP proxy and the ingress: the first half of the hop;
plain: the engine's metrics) and a greedy 1-token completion of a short prompt (the hop plus the lightest
model request). Reports the medians and 90th percentiles of each, and the median of the per-pair
differences.

    python scripts/hop_overhead.py /work/bench-models/qwen3_5-fp32 --threads 1 --pairs 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from load_test import Server

PLAIN, RAY = "onnxgen serve", "onnxgen serve --ray, 1 replica"


def timed(call: Callable[[httpx.Client], httpx.Response], client: httpx.Client) -> float:
    start = time.perf_counter()
    response = call(client)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="model directory")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each engine (default 1)")
    p.add_argument("--pairs", type=int, default=200, help="requests of each kind per server (default 200)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    log = (args.out or Path("hop_overhead.json")).with_suffix(".server.log")
    servers = {PLAIN: Server(args.model, args.threads, 4, log)}
    try:
        ray_log = log.with_suffix(".ray.log")
        servers[RAY] = Server(args.model, args.threads, 4, ray_log, ("--ray", "--replicas", "1"))
        clients = {name: httpx.Client(base_url=s.url, timeout=60) for name, s in servers.items()}
        body = {"model": servers[PLAIN].name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        kinds: dict[str, Callable[[httpx.Client], httpx.Response]] = {
            "GET /v1/models": lambda c: c.get("/v1/models"),
            # on Ray answered by the ingress itself: the proxy and ingress part of the hop
            "GET /metrics": lambda c: c.get("/metrics"),
            "1-token completion": lambda c: c.post("/v1/completions", json=body),
        }
        times: dict[tuple[str, str], list[float]] = {(k, n): [] for k in kinds for n in servers}
        for kind, call in kinds.items():
            for client in clients.values():  # warm-up
                for _ in range(5):
                    timed(call, client)
            for i in range(args.pairs):
                order = list(clients.items()) if i % 2 == 0 else list(reversed(clients.items()))
                for name, client in order:
                    times[kind, name].append(timed(call, client))
    finally:
        for server in servers.values():
            server.close()
    report = {}
    for kind in kinds:
        plain, ray = (np.array(times[kind, n]) * 1000.0 for n in (PLAIN, RAY))
        report[kind] = {
            "plain_ms_p50_p90": [round(float(np.percentile(plain, q)), 2) for q in (50, 90)],
            "ray_ms_p50_p90": [round(float(np.percentile(ray, q)), 2) for q in (50, 90)],
            "added_ms_median_of_pairs": round(statistics.median(ray - plain), 2),
        }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
