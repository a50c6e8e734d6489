"""What a batched prefill saves: ``k`` prompts of ``T`` tokens as one ``k``-row forward against ``k`` forwards
of one row, in ms per prompt token.

``python scripts/prefill_rows.py MODEL_DIR [--threads 2] [--lengths 16,64] [--rows 2,8] [--rounds 3]``

For each length and row count, in turn within each round (the machine may be shared): one forward of
``rows`` prompts of ``length`` tokens on a ``rows``-row decode state (what the scheduler's batched prefill
runs), and the same prompts one after another on a one-row state (what it ran before); both keep the
logits the scheduler keeps (two positions where the export computes a lone row apart, else one). Prints
the median over rounds of each, per prompt token, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def open_session(model: Path, threads: int) -> object:
    from onnxgen.model import ModelPackage
    from onnxgen.runtime.graph_cache import session_graph
    from onnxgen.runtime.session import DecoderSession

    package = ModelPackage.open(model)
    return DecoderSession(
        session_graph(package.model_path, package.io, threads=threads), threads=threads, verify=False
    )


def prompts(rows: int, length: int, vocab: int) -> np.ndarray:
    """``rows`` different prompts of ``length`` spread-out token ids below ``min(vocab, 1001)``."""
    top = min(vocab, 1001) - 1
    return np.array([[(7919 * i + 131 * r + 13) % top + 1 for i in range(length)] for r in range(rows)])


def timed(session: object, state: object, ids: np.ndarray, keep: int) -> float:
    state.reset()  # type: ignore[attr-defined]
    start = time.perf_counter()
    session.forward(state, ids, keep)  # type: ignore[attr-defined]
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="16,64", help="prompt lengths (comma-separated)")
    p.add_argument("--rows", default="2,8", help="prompts per batched forward (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from onnxgen.graph.hybrid_ops import int8_activations
    from onnxgen.model import ModelPackage
    from onnxgen.runtime.batch import invariant_min_rows

    session = open_session(args.model, args.threads)
    graph = ModelPackage.open(args.model).graph
    keep = 2 if invariant_min_rows(graph, session) >= 2 else 1  # type: ignore[arg-type]
    print(f"{args.model.name}: int8 activations {int8_activations(graph)}, logits kept {keep}")
    del graph
    lengths = [int(x) for x in args.lengths.split(",")]
    row_counts = [int(x) for x in args.rows.split(",")]
    capacity = max(lengths) + 2
    lone = session.new_state(capacity)  # type: ignore[attr-defined]
    states = {k: session.new_state(capacity, k) for k in row_counts}  # type: ignore[attr-defined]
    vocab = session.vocab_size  # type: ignore[attr-defined]
    for length in lengths:  # warm-up: each shape once
        timed(session, lone, prompts(1, length, vocab), keep)
        for k in row_counts:
            timed(session, states[k], prompts(k, length, vocab), keep)
    batched: dict[tuple[int, int], list[float]] = {}
    alone: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for length in lengths:
            for k in row_counts:
                ids = prompts(k, length, vocab)
                batched.setdefault((length, k), []).append(timed(session, states[k], ids, keep))
                each = sum(timed(session, lone, ids[r : r + 1], keep) for r in range(k))
                alone.setdefault((length, k), []).append(each)
    print(f"{'tokens':>6} {'rows':>4} {'alone ms/token':>15} {'batched ms/token':>17} {'batched/alone':>14}")
    for (length, k), times in batched.items():
        one = statistics.median(alone[(length, k)]) / (length * k) * 1000
        many = statistics.median(times) / (length * k) * 1000
        print(f"{length:6} {k:4} {one:15.1f} {many:17.1f} {many / one:14.2f}")


if __name__ == "__main__":
    main()
