"""Plain rows beside a speculative request: do they decode slower than beside a plain neighbour?

Runs the engine in process (no HTTP) on one model, interleaving five loads per round:

- ``alone``: ``--rows`` plain greedy requests;
- ``plain``: the same, plus one more plain request (the neighbour);
- ``spec``: the same, plus that neighbour drafting with prompt lookup (it yields to the plain rows:
  it decodes as a batch row while they decode, in its lane once they are done);
- ``solo-plain``, ``solo-spec``: the neighbour alone, plain and drafting (its own speed, in its lane).

Each request decodes ``--new-tokens`` tokens with ``ignore_eos``; the neighbour's prompt repeats itself, so
prompt lookup's drafts get accepted. Reported per load: the median over rounds of the plain rows' median
decode rate (tokens/s after the first token), and the neighbour's rate.

    python scripts/bench_spec_lanes.py /work/bench-models/qwen3-fp32 --threads 2 --rounds 5
    python scripts/bench_spec_lanes.py bundled --threads 2 --rounds 5   # the bundled demo model
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
    yields = getattr(engine.scheduler, "yields", 0)  # (0 where the engine never yields)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason is not None:
                stats[out.request_id] = out.stats or {}
    plain = statistics.median(stats[i]["decode_tok_s"] for i in range(len(prompts))) if prompts else 0.0
    n = stats.get("n", {})
    yields = getattr(engine.scheduler, "yields", 0) - yields
    return {"plain": plain, "neighbour": n.get("decode_tok_s", 0.0), "yields": yields}


def workload(llm: LLM, rows: int) -> tuple[list[list[int]], list[int]]:
    """The plain rows' prompts (~64 tokens each) and the neighbour's self-repeating one (~72 tokens): text
    through the model's tokenizer where it has one, else token ids."""
    if llm.tokenizer is None:
        prompts = [[(37 * i + 11 * k) % 1000 + 3 for i in range(64)] for k in range(rows)]
        head = [(53 * i + 7) % 1000 + 3 for i in range(24)]
        return prompts, head * 3
    topics = ("the sea", "a mountain village", "the history of clocks", "a train journey", "bread")
    prompts = [
        llm.encode(f"Write a long story about {topics[k % len(topics)]}. " * 6)[:64] for k in range(rows)
    ]
    head = llm.encode("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. ")
    return prompts, (head * 4)[:72]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model directory, or 'bundled' for the bundled demo model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    model = None if args.model == "bundled" else args.model
    llm: LLM = onnxgen.load(model, threads=args.threads, max_batch=args.rows + 1, min_rows=1)
    prompts, neighbour = workload(llm, args.rows)
    engine = llm.engine()
    run(engine, prompts, neighbour, True, 8)  # warm-up: sessions, verify graphs
    run(engine, [], neighbour, True, 8)
    loads = {
        "alone": (prompts, None, False),
        "plain": (prompts, neighbour, False),
        "spec": (prompts, neighbour, True),
        "solo-plain": ([], neighbour, False),
        "solo-spec": ([], neighbour, True),
    }
    results: dict[str, list[dict[str, float]]] = {load: [] for load in loads}
    for _ in range(args.rounds):
        for load, (rows, other, spec) in loads.items():
            results[load].append(run(engine, rows, other, spec, args.new_tokens))
    print(f"model {args.model}, {args.rows} plain rows, {args.new_tokens} new tokens, {args.rounds} rounds")
    print("load        plain rows tok/s  neighbour tok/s  yields  per round (plain rows | neighbour)")
    for load, rounds in results.items():
        plain = statistics.median(r["plain"] for r in rounds)
        other = statistics.median(r["neighbour"] for r in rounds)
        yields = statistics.median(r["yields"] for r in rounds)
        per = ", ".join(f"{r['plain']:.1f}|{r['neighbour']:.1f}" for r in rounds)
        print(f"{load:11} {plain:16.1f}  {other:15.1f}  {yields:6.0f}  {per}")
    for what, a, b, key in (
        ("plain rows beside a speculative / a plain neighbour", "spec", "plain", "plain"),
        ("the neighbour alone, speculative / plain", "solo-spec", "solo-plain", "neighbour"),
    ):
        ratios = sorted(x[key] / y[key] for x, y in zip(results[a], results[b], strict=True) if y[key] > 0)
        if ratios:
            print(
                f"{what}: median of per-round ratios {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
            )


if __name__ == "__main__":
    main()
