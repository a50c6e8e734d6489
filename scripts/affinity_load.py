"""Prefix-affinity hit rate of ``onnxgen serve --ray`` under concurrent multi-turn chats.

Starts ``onnxgen serve MODEL --ray --replicas N --threads T`` on 127.0.0.1 (scripts/load_test.py's
``Server``), then runs C conversations at once, each T turns of greedy chat (a shared system prompt, a
different first question per conversation, each reply appended before the next question), and reports:
how many follow-up turns landed on the replica that served the turn before, the router's own count of
prefix hits (the ingress's ``onnxgen_routed_requests_total`` by ``how``), how the conversations spread
over the replicas, and the median turn latency. Every count and wait is bounded.

    python scripts/affinity_load.py /work/bench-models/qwen3_5-fp32 --conversations 8 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from load_test import Server

SYSTEM = "You are a helpful assistant. Answer briefly and stay on the topic of the question."


async def conversation(
    client: httpx.AsyncClient, model: str, index: int, turns: int, max_tokens: int
) -> list[tuple[str, float]]:
    """(replica, seconds) per turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    served = []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"Conversation {index}, question {turn}: why is the sky blue?"}
        )
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        start = time.perf_counter()
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        served.append((response.headers["x-onnxgen-replica"], time.perf_counter() - start))
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    return served


def routed(url: str) -> Counter[str]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "onnxgen_routed_requests_total":
                counts[sample.labels["how"]] += int(sample.value)
    return counts


async def run(url: str, model: str, args: argparse.Namespace) -> list[list[tuple[str, float]]]:
    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        jobs = [
            conversation(client, model, i, args.turns, args.max_tokens) for i in range(args.conversations)
        ]
        return await asyncio.gather(*jobs)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="model directory (with a chat template)")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--threads", type=int, default=1, help="threads per replica (default 1)")
    p.add_argument("--conversations", type=int, default=8, help="conversations at once (default 8)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (default 16)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    log = (args.out or Path("affinity_load.json")).with_suffix(".server.log")
    flags = ("--ray", "--replicas", str(args.replicas))
    server = Server(args.model, args.threads, max(args.conversations, 1), log, flags)
    try:
        before = routed(server.url)
        results = asyncio.run(run(server.url, server.name, args))
        counts = routed(server.url) - before
    finally:
        server.close()
    follow_ups = [(a[0], b[0]) for turns in results for a, b in itertools.pairwise(turns)]
    stayed = sum(a == b for a, b in follow_ups)
    first = Counter(turns[0][0] for turns in results)
    report = {
        "model": str(args.model),
        "replicas": args.replicas,
        "conversations": args.conversations,
        "turns": args.turns,
        "follow_ups_on_the_previous_turns_replica": f"{stayed}/{len(follow_ups)}",
        "router_decisions": dict(counts),
        # a first turn has no history to find: the best rate is follow-ups / requests
        "prefix_hit_rate": round((counts["prefix"] + counts["held"]) / max(sum(counts.values()), 1), 3),
        "best_possible_hit_rate": round(len(follow_ups) / max(sum(len(t) for t in results), 1), 3),
        "first_turns_per_replica": sorted(first.values(), reverse=True),
        "turn_latency_ms_median": round(
            1000 * statistics.median(s for turns in results for _, s in turns), 1
        ),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
