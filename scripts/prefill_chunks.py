"""Prefill of one prompt in one forward or in chunks: time and output bits, in one process.

``python scripts/prefill_chunks.py MODEL_DIR [--threads 2] [--prompt-tokens 512] [--chunks 512,256,128]
[--rounds 3]``

One session; per round, in shuffled order, one prefill per chunk size (the prompt fed in forwards of at most
that many tokens, the last position's logits kept). Prints each chunk size's median seconds, the median over
rounds of its time against the whole-prompt forward (the first chunk size), whether its logits are
bit-identical to that forward's, and the minor page faults a prefill took.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import numpy as np

from onnxgen.model import ModelPackage
from onnxgen.runtime import hugepages
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession


def prefill(session: DecoderSession, prompt: np.ndarray, chunk: int) -> tuple[float, np.ndarray, int]:
    """Seconds, the last position's logits and the minor page faults of one prefill."""
    state = session.new_state(prompt.shape[1] + 1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    for i in range(0, prompt.shape[1], chunk):
        logits = session.forward(state, prompt[:, i : i + chunk], 1)
    took = time.perf_counter() - started
    return took, np.array(logits, copy=True), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--chunks", default="512,256,128")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    package = ModelPackage.open(args.model)
    session = DecoderSession(
        session_graph(package.model_path, package.io, threads=args.threads),
        threads=args.threads,
        verify=False,
    )
    hugepages.wait()
    vocab = session.vocab_size
    prompt = np.array(
        [[1 + (7919 * i + 13) % (vocab - 1) for i in range(args.prompt_tokens)]], dtype=np.int64
    )
    chunks = [int(c) for c in args.chunks.split(",")]
    got: dict[int, list[tuple[float, np.ndarray, int]]] = {c: [] for c in chunks}
    for _ in range(args.rounds):
        for c in random.sample(chunks, len(chunks)):
            got[c].append(prefill(session, prompt, c))
    base = chunks[0]
    print(f"{args.model}: {args.threads} threads, prompt {args.prompt_tokens}, {args.rounds} rounds")
    for c in chunks:
        ratio = [r[0] / b[0] for r, b in zip(got[c], got[base], strict=True)]
        same = all(np.array_equal(r[1], got[base][0][1]) for r in got[c])
        print(
            f"  chunk {c}: {statistics.median(r[0] for r in got[c]):.3f} s, against {base}: "
            f"{statistics.median(ratio):.3f} ({', '.join(f'{x:.3f}' for x in ratio)}); logits bit-identical {same}; "
            f"page faults {statistics.median(r[2] for r in got[c]):.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
