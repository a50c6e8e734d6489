"""In-process A/B of a session-graph pass: prefill time and decode steps, variants in shuffled rounds.

``python scripts/graph_ab.py MODEL_DIR --pass tail_rows [--threads 2] [--prompt-tokens 16,512] [--steps 32]
[--rounds 4] [--groups NAME]``

One process makes one :class:`~onnxgen.runtime.session.DecoderSession` per variant (the pass on, the pass
off; made in random order, each graph prepared in the cache under its own settings) and runs, per round and
prompt length, in shuffled variant order: a prefill of the prompt (kept logits of its last position) and
``--steps`` greedy decode steps. Prints per variant and prompt length the median prefill seconds and the
median decode-step milliseconds (the first two steps left out) and the first step's, the medians over rounds of off / on
(> 1: the pass is faster), and whether the variants gave bit-identical prefill logits and the same tokens.

- ``tail_rows``: the last layer's position-wise tail on the kept rows only (:mod:`onnxgen.graph.kept_rows`)
  against the logits-to-keep slice right before the lm_head.
- ``matmul_merge``: sibling ``MatMulNBits`` projections of one input merged into one node and a ``Split``
  (:func:`onnxgen.graph.decode_fusions.merge_sibling_matmuls`) against the separate projections, at any
  ``--threads`` (the engine merges only from two: :func:`onnxgen.graph.decode_fusions.merge_pays`); with
  ``--groups NAME`` the pass merges only the groups whose first node's name holds ``NAME`` (``mlp/``: the
  MLPs' gate and up projections; ``linear_attn/``: a linear attention's qkv and z projections), so that each
  kind of group is measured on its own (that graph prepared in a cache folder of its own);
- ``l2_norms``: a linear attention's query and key L2 norms as one normalization
  (:func:`onnxgen.graph.decode_fusions.merge_l2_norms`) against the two (that graph prepared in a cache
  folder of its own under the temporary directory).
- ``arena_shrink``: the first decode step after a prefill hands the arena's unused regions back (what a
  session does) against a session that keeps them (two sessions of one graph): the next prefill's page
  faults and time.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from onnxgen.graph import decode_fusions
from onnxgen.model import ModelPackage
from onnxgen.runtime import hugepages
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession

WARM_STEPS = 2  # leading decode steps left out of each median


OFF_CACHE = Path(tempfile.gettempdir()) / "onnxgen-graph-ab-off"  # graphs prepared without the pass
REWRITES = {"l2_norms": "merge_l2_norms", "matmul_merge": "merge_sibling_matmuls"}  # decode_fusions' own


def make_session(
    package: ModelPackage, threads: int, feature: str, on: bool, groups: str | None = None
) -> DecoderSession:
    # graphs prepared for the session's threads, as the engine does; matmul_merge's as for two threads or
    # more (decode_fusions.merge_pays): sibling MatMulNBits merged, so the merge is measured on one thread too
    graph_threads = max(threads, decode_fusions.MERGE_MIN_THREADS) if feature == "matmul_merge" else threads
    if feature == "matmul_merge" and on and groups:  # only the named groups merged
        kept = decode_fusions.sibling_groups
        with mock.patch.object(
            decode_fusions, "sibling_groups", lambda m: [g for g in kept(m) if groups in g[0].name]
        ):
            graph = session_graph(
                package.model_path,
                package.io,
                graph=package.graph,
                cache_dir=OFF_CACHE / f"{feature}-only-{groups.strip('/')}",
                threads=graph_threads,
            )
    elif feature == "tail_rows":
        graph = session_graph(
            package.model_path, package.io, graph=package.graph, tail_rows=on, threads=graph_threads
        )
    elif feature == "arena_shrink":  # one graph; the session "off" never shrinks its arena after a prefill
        session = DecoderSession(
            session_graph(package.model_path, package.io, graph=package.graph, threads=graph_threads),
            threads=threads,
            verify=False,
        )
        if not on:
            session._shrink_options = session._run_options
        return session
    elif feature in REWRITES and on:
        graph = session_graph(package.model_path, package.io, graph=package.graph, threads=graph_threads)
    elif feature in REWRITES:  # the same settings (the same cache key) prepared without the rewrite
        with mock.patch.object(decode_fusions, REWRITES[feature], lambda *a, **k: None):
            graph = session_graph(
                package.model_path,
                package.io,
                graph=package.graph,
                cache_dir=OFF_CACHE / feature,
                threads=graph_threads,
            )
    else:
        raise SystemExit(f"unknown pass {feature!r}")
    return DecoderSession(graph, threads=threads, verify=False)


def run(
    session: DecoderSession, prompt: list[int], steps: int
) -> tuple[float, list[float], list[int], np.ndarray, int]:
    """Prefill seconds, every decode step's seconds, greedy tokens, the prefill's logits and the page faults the
    prefill took (the process's minor faults: activation memory touched for the first time)."""
    state = session.new_state(len(prompt) + steps + 1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    logits = session.forward(state, np.array([prompt], dtype=np.int64), 1)[0, -1]
    prefill = time.perf_counter() - started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    first = np.array(logits, copy=True)
    tokens = [int(first.argmax())]
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = session.step(state, tokens[-1])
        times.append(time.perf_counter() - started)
        tokens.append(int(logits.argmax()))
    return prefill, times, tokens, first, faults


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--pass", dest="feature", required=True, choices=["tail_rows", *REWRITES, "arena_shrink"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", default="16,512")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--groups", default=None, help="matmul_merge: merge only the groups whose name holds this")
    args = p.parse_args(argv)
    if args.groups and args.feature != "matmul_merge":
        p.error("--groups selects sibling MatMulNBits groups: it goes with --pass matmul_merge")
    package = ModelPackage.open(args.model)
    sessions = {}
    for on in random.sample([True, False], 2):
        sessions[on] = make_session(package, args.threads, args.feature, on, args.groups)
    hugepages.wait()
    vocab = sessions[True].vocab_size
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    prompts = {n: [1 + (7919 * i + 13) % (vocab - 1) for i in range(n)] for n in lengths}
    got: dict[tuple[bool, int], list] = {(on, n): [] for on in sessions for n in lengths}
    for _ in range(args.rounds):
        for n in lengths:
            for on in random.sample(list(sessions), 2):
                got[on, n].append(run(sessions[on], prompts[n], args.steps))
    print(
        f"{args.model}: --pass {args.feature}{f' --groups {args.groups}' if args.groups else ''}, {args.threads} threads, {args.rounds} rounds, {args.steps} steps"
    )
    for on in (True, False):
        print(f"  pass {'on' if on else 'off'}: decode fusions: {sessions[on].fusions.summary()}")
    for n in lengths:
        on, off = got[True, n], got[False, n]
        same_bits = all(np.array_equal(a[3], b[3]) for a, b in zip(on, off, strict=True))
        same_tokens = all(a[2] == b[2] for a, b in zip(on, off, strict=True))
        prefill = [b[0] / a[0] for a, b in zip(on, off, strict=True)]
        step = [
            statistics.median(b[1][WARM_STEPS:]) / statistics.median(a[1][WARM_STEPS:])
            for a, b in zip(on, off, strict=True)
        ]
        print(
            f"  prompt {n}: prefill s on {statistics.median(r[0] for r in on):.3f} off "
            f"{statistics.median(r[0] for r in off):.3f} (off/on per round {statistics.median(prefill):.3f}: "
            f"{', '.join(f'{x:.3f}' for x in prefill)}); step ms on "
            f"{1e3 * statistics.median(t for r in on for t in r[1][WARM_STEPS:]):.2f} off "
            f"{1e3 * statistics.median(t for r in off for t in r[1][WARM_STEPS:]):.2f} "
            f"(off/on {statistics.median(step):.3f}: {', '.join(f'{x:.3f}' for x in step)}); first step ms on "
            f"{1e3 * statistics.median(r[1][0] for r in on):.1f} off {1e3 * statistics.median(r[1][0] for r in off):.1f}; "
            f"prefill logits bit-identical {same_bits}, tokens equal {same_tokens}; prefill page faults on "
            f"{statistics.median(r[4] for r in on):.0f} off {statistics.median(r[4] for r in off):.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
