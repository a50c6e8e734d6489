"""What a speculative verify of k draft tokens costs against one decode step, and what that buys.

``python scripts/verify_cost.py MODEL_DIR [--threads 2] [--max-k 8] [--repeats 7] [--prompt-tokens 16]
[--prompt-file FILE] [--mtp] [--target 1.5]``

The model is loaded for speculation (``load(..., speculative=True)``: a hybrid runs its verify plan's graph
from the start). After a prefill, every measurement runs at the same position: a plain single-token step,
then a verify forward over the pending token and k drafts (k = 1..max-k) that fetches the verify plan's
outputs, as the speculative loop does; the state is restored after each (KV rewound, recurrent states
from a snapshot), outside the timed part. The drafts are the model's own greedy continuation (an oracle
that knows it). Timed apart: the verify forward (all a full accept costs), and for hybrids the commit of
a partial accept (the verify plan re-runs the state updates over the kept tokens, here the first half).

``--mtp`` (a model with an MTP head): verifies also fetch the final hidden state, and the head's forwards
are timed as the engine runs them (one thread, int4 lm_head): the draft cost ``d`` is the median of a
forward over the kept entries after a verify and of a chained single-entry one (a proposal of k drafts
runs k of them, interleaved with the step and verify timings).

Prints, per k, the median forward and commit times over the median step time, and the decode speedup a
proposer would give at per-token acceptance a (each draft accepted with probability a until the first
miss): tokens per verify = (1 - a^(k+1)) / (1 - a), cost = forward + (1 - a^k) x commit + k x d,
speedup = tokens per verify / (cost / step) (d = 0 without ``--mtp``: prompt lookup's is microseconds);
and the acceptance that speedup needs to reach ``--target``, or "-" where no acceptance below 1 does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def speedup(a: float, k: int, forward: float, commit: float, draft: float) -> float:
    """Tokens per verify over its cost in steps: forward, commit (partial accepts) and k drafts."""
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens / (forward + (1 - a**k) * commit + k * draft)


def needed(target: float, k: int, forward: float, commit: float, draft: float) -> float | None:
    """The per-draft acceptance at which ``speedup`` reaches ``target`` (None: not below 1)."""
    lo, hi = 0.0, 0.9999
    if speedup(hi, k, forward, commit, draft) < target:
        return None
    for _ in range(50):  # speedup grows with a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid, k, forward, commit, draft) < target else (lo, mid)
    return hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, nargs="?", help="model directory (default: the bundled model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--prompt-file", type=Path, help="a prompt text instead of --prompt-tokens synthetic ids")
    p.add_argument("--mtp", action="store_true", help="time the MTP head's draft forwards too")
    p.add_argument("--target", type=float, default=1.5, help="speedup to solve the acceptance for")
    args = p.parse_args(argv)

    import onnxgen

    llm = onnxgen.load(args.model, threads=args.threads, speculative=True)
    session = llm.session
    vocab = session.vocab_size
    if args.prompt_file is not None:
        prompt = llm.tokenizer.encode(args.prompt_file.read_text())
    else:
        prompt = [1 + (7919 * i + 13) % (vocab - 1) for i in range(args.prompt_tokens)]
    oracle = llm.generate(
        prompt, onnxgen.SamplingParams(max_new_tokens=args.max_k + 2, temperature=0.0, detokenize=False)
    ).token_ids
    plan = session.verify_plan
    fetch = plan.outputs if plan is not None else ()
    if args.mtp:
        fetch = (*fetch, session.hidden_state)
    state = session.new_state(len(prompt) + args.max_k + 4)
    fetched: dict = {}
    session.forward(state, np.array([prompt]), None if args.mtp else 1, fetch=fetch, fetched=fetched)
    draft = head_timer(llm, prompt, fetched[session.hidden_state]) if args.mtp else None
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
    drafts: list[float] = []
    for _ in range(args.repeats):
        for k in range(args.max_k + 1):
            times[k].append(timed(k))
            if draft is not None:
                drafts.extend(draft())
    report(args, plan, times, drafts)
    return 0


def head_timer(llm: object, prompt: list[int], hidden: object) -> object:
    """A function timing two head forwards as a proposal runs them: one over two new entries (a verify
    kept one draft), one chained entry; the head's cache is rewound after each."""
    head = llm.mtp_head()  # type: ignore[attr-defined]
    state = head.new_state(len(prompt) + 4)
    rows = hidden.numpy()[:, : len(prompt) - 3].copy()  # type: ignore[attr-defined]
    head.forward(state, np.array([prompt[1 : len(prompt) - 2]]), rows)
    base = state.length
    pair, one = np.array([prompt[-2:]]), np.array([prompt[-1:]])
    new = np.ascontiguousarray(hidden.numpy()[:, len(prompt) - 3 : len(prompt) - 1])  # type: ignore[attr-defined]

    def timed() -> list[float]:
        out = []
        t = time.perf_counter()
        _, h = head.forward(state, pair, new)
        out.append(time.perf_counter() - t)
        t = time.perf_counter()
        head.forward(state, one, h[None, None])
        out.append(time.perf_counter() - t)
        state.rewind(base)
        return out

    return timed


def report(args: argparse.Namespace, plan: object, times: dict, drafts: list[float]) -> None:
    step = statistics.median(f for f, _ in times[0])
    d = statistics.median(drafts) / step if drafts else 0.0
    print(
        f"model {args.model or '(bundled)'}, {args.threads} threads, verify plan: {plan.strategy if plan else 'none'}"
    )  # type: ignore[attr-defined]
    print(f"one decode step: {1000 * step:.2f} ms (median of {args.repeats})")
    if drafts:
        print(f"one MTP head forward: {1000 * d * step:.2f} ms = {d:.2f} steps (median of {len(drafts)})")
    alphas = (0.35, 0.5, 0.7, 0.9)
    head = f"{'k':>3} {'forward ms':>11} {'/step':>6} {'commit ms':>10} {'/step':>6} "
    print(
        head
        + " ".join(f"{'speedup@' + str(a):>13}" for a in alphas)
        + f" {'a for ' + str(args.target) + 'x':>10}"
    )
    for k in range(1, args.max_k + 1):
        forward = statistics.median(f for f, _ in times[k]) / step
        commit = statistics.median(c for _, c in times[k]) / step
        gains = [speedup(a, k, forward, commit, d) for a in alphas]
        a = needed(args.target, k, forward, commit, d)
        print(
            f"{k:3d} {1000 * forward * step:11.2f} {forward:6.2f} {1000 * commit * step:10.2f} {commit:6.2f} "
            + " ".join(f"{g:12.2f}x" for g in gains)
            + f" {'-' if a is None else f'{a:.2f}':>10}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
