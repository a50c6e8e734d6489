"""What a speculative verify of k draft tokens costs against one decode step, and what that buys.

``python scripts/verify_cost.py MODEL_DIR [--threads 2] [--max-k 8] [--repeats 7] [--prompt-tokens 16]``

The model is loaded for speculation (``load(..., speculative=True)``: a hybrid runs its verify plan's graph
from the start). After a prefill, every measurement runs at the same position: a plain single-token step,
then a verify forward over the pending token and k drafts (k = 1..max-k) that fetches the verify plan's
outputs, as the speculative loop does; the state is restored after each (KV rewound, recurrent states
from a snapshot), outside the timed part. The drafts are the model's own greedy continuation (an oracle
that knows it). Timed apart: the verify forward (all a full accept costs), and for hybrids the commit of
a partial accept (the verify plan re-runs the state updates over the kept tokens, here the first half).

Prints, per k, the median forward and commit times over the median step time, and the decode speedup a
proposer would give at per-token acceptance a (each draft accepted with probability a until the first
miss): tokens per verify = (1 - a^(k+1)) / (1 - a), cost = forward + (1 - a^k) x commit, speedup =
tokens per verify / (cost / step); proposal cost not included (prompt lookup's is microseconds; MTP
heads add their own forward).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt-tokens", type=int, default=16)
    args = p.parse_args(argv)

    import onnxgen

    llm = onnxgen.load(args.model, threads=args.threads, speculative=True)
    session = llm.session
    vocab = session.vocab_size
    prompt = [1 + (7919 * i + 13) % (vocab - 1) for i in range(args.prompt_tokens)]
    oracle = llm.generate(
        prompt, onnxgen.SamplingParams(max_new_tokens=args.max_k + 2, temperature=0.0, detokenize=False)
    ).token_ids
    plan = session.verify_plan
    fetch = plan.outputs if plan is not None else ()
    state = session.new_state(args.prompt_tokens + args.max_k + 4)
    session.forward(state, np.array([prompt]), 1)
    start = state.length

    def timed(k: int) -> tuple[float, float]:
        """One forward over the pending token and k drafts (k = 0: a plain step) and the commit of the
        first half of them; the state restored after."""
        snap = state.snapshot() if session.io.state_pairs else None
        fetched: dict = {}
        t = time.perf_counter()
        if k == 0:
            session.step(state, oracle[0])
        else:
            session.forward(
                state, np.array([oracle[: k + 1]]), k + 1, fetch=fetch, fetched=fetched, copy=False
            )
        forward, commit = time.perf_counter() - t, 0.0
        if k and plan is not None and snap is not None:
            t = time.perf_counter()
            plan.commit(state, snap, fetched, k + 1, k // 2 + 1)
            commit = time.perf_counter() - t
        if snap is not None:
            state.restore(snap)
            state.release(snap)
        else:
            state.rewind(start)
        return forward, commit

    for k in range(args.max_k + 1):  # warm every shape
        timed(k)
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in range(args.max_k + 1)}
    for _ in range(args.repeats):
        for k in range(args.max_k + 1):
            times[k].append(timed(k))
    step = statistics.median(f for f, _ in times[0])
    print(f"model {args.model}, {args.threads} threads, verify plan: {plan.strategy if plan else 'none'}")
    print(f"one decode step: {1000 * step:.1f} ms (median of {args.repeats})")
    alphas = (0.5, 0.7, 0.9)
    head = f"{'k':>3} {'forward ms':>11} {'/step':>6} {'commit ms':>10} {'/step':>6} "
    print(head + " ".join(f"{'speedup@' + str(a):>12}" for a in alphas))
    for k in range(1, args.max_k + 1):
        forward = statistics.median(f for f, _ in times[k]) / step
        commit = statistics.median(c for _, c in times[k]) / step
        gains = [(1 - a ** (k + 1)) / (1 - a) / (forward + (1 - a**k) * commit) for a in alphas]
        print(
            f"{k:3d} {1000 * forward * step:11.1f} {forward:6.2f} {1000 * commit * step:10.2f} {commit:6.2f} "
            + " ".join(f"{g:11.2f}x" for g in gains)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
