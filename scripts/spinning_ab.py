"""Batched decode steps with onnxruntime's intra-op threads spinning, sleeping, and with one thread.

``python scripts/spinning_ab.py MODEL_DIR [--rows 1,4,8] [--steps 6] [--rounds 3]``

For each round, each variant in turn opens its own session (one model in memory at a time; the order of
creation is the same in every round) and times ``--steps`` decode steps of ``n`` rows through the server's
path (:func:`batch_profile.time_steps`). Prints per variant the median over rounds of the median step,
and its ratio to one row. The variants give the same logits: only how the threads wait differs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path

from batch_profile import time_steps, token_ids

VARIANTS = {"2 threads, spinning": (2, True), "2 threads, sleeping": (2, False), "1 thread": (1, True)}


def main(argv: list[str] | None = None) -> int:
    from onnxgen.model import ModelPackage
    from onnxgen.runtime.graph_cache import session_graph
    from onnxgen.runtime.session import DecoderSession

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    package = ModelPackage.open(args.model)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (threads, spinning) in VARIANTS.items():
            graph = session_graph(package.model_path, package.io, threads=threads)
            session = DecoderSession(graph, threads=threads, spinning=spinning, verify=False)
            prompt = token_ids(64, session.vocab_size)
            for n in rows:
                times[name][n].append(time_steps(session, n, prompt, args.steps, 1)[0])
            del session
            gc.collect()
    print(f"model {args.model}, 64-token rows, median step of {args.steps}, median of {args.rounds} rounds")
    for name in VARIANTS:
        one = statistics.median(times[name][rows[0]])
        cells = [f"{n} rows {statistics.median(times[name][n]) * 1e3:7.0f} ms" for n in rows]
        ratios = [f"{statistics.median(times[name][n]) / one:.2f}x" for n in rows]
        print(f"{name:22} " + "  ".join(f"{c} ({r})" for c, r in zip(cells, ratios, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
