"""Plain rows beside a speculative lane: do they decode slower than beside a plain neighbour?

Runs the engine in process (no HTTP) on one model, interleaving three loads per round:

- ``alone``: ``--rows`` plain greedy requests;
- ``plain``: the same, plus one more plain request (the neighbour);
- ``spec``: the same, plus that neighbour drafting with prompt lookup (a lane beside the batch).

Each request decodes ``--new-tokens`` tokens with ``ignore_eos``; the neighbour's prompt repeats itself, so
prompt lookup's drafts get accepted. Reported per load: the median over rounds of the plain rows' median
decode rate (tokens/s after the first token), and the neighbour's rate.

    python scripts/bench_spec_lanes.py /work/bench-models/qwen3-fp32 --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import onnxgen
from onnxgen import LLM, PromptLookup, SamplingParams
from onnxgen.engine.engine import Engine


def run(
    engine: Engine, prompts: list[list[int]], neighbour: list[int] | None, spec: bool, new: int
) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(i, ids, params)
    if neighbour is not None:
        engine.add_request("n", neighbour, params, PromptLookup(num_draft_tokens=4) if spec else None)
    stats: dict[Any, dict[str, Any]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason is not None:
                stats[out.request_id] = out.stats or {}
    plain = statistics.median(stats[i]["decode_tok_s"] for i in range(len(prompts)))
    return {"plain": plain, "neighbour": stats["n"]["decode_tok_s"] if neighbour is not None else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    llm: LLM = onnxgen.load(args.model, threads=args.threads, max_batch=args.rows + 1, min_rows=1)
    prompts = [[(37 * i + 11 * k) % 1000 + 3 for i in range(64)] for k in range(args.rows)]
    head = [(53 * i + 7) % 1000 + 3 for i in range(24)]
    neighbour = head * 3
    engine = llm.engine()
    run(engine, prompts, neighbour, True, 8)  # warm-up: sessions, verify graphs
    results: dict[str, list[dict[str, float]]] = {"alone": [], "plain": [], "spec": []}
    for _ in range(args.rounds):
        results["alone"].append(run(engine, prompts, None, False, args.new_tokens))
        results["plain"].append(run(engine, prompts, neighbour, False, args.new_tokens))
        results["spec"].append(run(engine, prompts, neighbour, True, args.new_tokens))
    print(f"model {args.model}, {args.rows} plain rows, {args.new_tokens} new tokens, {args.rounds} rounds")
    print("load   plain rows tok/s (median)   neighbour tok/s (median)   per round (plain rows)")
    for load, rounds in results.items():
        plain = statistics.median(r["plain"] for r in rounds)
        neighbour = statistics.median(r["neighbour"] for r in rounds)
        per = ", ".join(f"{r['plain']:.1f}" for r in rounds)
        print(f"{load:6} {plain:26.1f}   {neighbour:24.1f}   {per}")


if __name__ == "__main__":
    main()
