"""Does a sequence decode alike alone and in a batch? Greedy runs on one export, three ways.

1. ``single``: each prompt alone through ``DecoderSession.forward`` (what ``LLM.generate`` does);
2. ``batch``: all prompts as rows of one ``BatchState``;
3. ``pairs`` / ``padded``: the prompts in batches of two, and each prompt alone in a ``BatchState`` padded
   to two rows (``min_rows=2``, what ``onnxgen serve`` does by default).

Prints, per prompt, whether ``batch`` equals ``single`` (and where not: the first differing token, the logit
margin between the two candidate tokens in the single run, the largest logit difference before it), and
whether ``batch``, ``pairs`` and ``padded`` give bit-identical logits.

    python scripts/batch_invariance.py /work/bench-models/qwen3_5-int4
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from onnxgen import load
from onnxgen.runtime.batch import BatchState
from onnxgen.runtime.session import DecoderSession

LENGTHS = (16, 32, 64, 128, 20, 40, 80, 100)
Run = tuple[list[int], np.ndarray]  # greedy tokens, logits of every step


def single(session: DecoderSession, prompt: list[int], steps: int) -> Run:
    state = session.new_state(len(prompt) + steps + 1)
    rows = [session.forward(state, np.asarray([prompt]), 1)[0, -1]]
    tokens: list[int] = []
    for _ in range(steps - 1):
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(session.forward(state, np.asarray([[tokens[-1]]]), 1)[0, -1])
    tokens.append(int(np.argmax(rows[-1])))
    return tokens, np.stack(rows)


def batched(
    session: DecoderSession, prompts: Sequence[list[int]], steps: int, min_rows: int = 1
) -> list[Run]:
    batch = BatchState(session, max(len(prompts), min_rows), 512, min_rows=min_rows)
    prefill = session.new_state(512)
    logits: list[list[np.ndarray]] = []
    for prompt in prompts:
        prefill.reset()
        logits.append([session.forward(prefill, np.asarray([prompt]), 1)[0, -1]])
        batch.admit(prefill)
    tokens = [[int(np.argmax(rows[0]))] for rows in logits]
    for _ in range(steps - 1):
        out = batch.step([t[-1] for t in tokens])
        for r in range(len(prompts)):
            logits[r].append(out[r])
            tokens[r].append(int(np.argmax(out[r])))
    return [(t, np.stack(rows)) for t, rows in zip(tokens, logits, strict=True)]


def describe(alone: Run, batch: Run) -> str:
    if alone[0] == batch[0]:
        return f"same tokens; largest logit difference {np.abs(alone[1] - batch[1]).max():.2e}"
    at = next(i for i, (a, b) in enumerate(zip(alone[0], batch[0], strict=True)) if a != b)
    row = alone[1][at]
    margin = row[alone[0][at]] - row[batch[0][at]]
    before = np.abs(alone[1][: at + 1] - batch[1][: at + 1]).max()
    return f"differs at token {at}: margin {margin:.2e} in the single run, logits {before:.2e} apart before"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="model directory")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    session = load(args.model, threads=args.threads).session
    rng = np.random.default_rng(1)
    vocab = session.vocab_size
    prompts = [rng.integers(min(100, vocab // 2), vocab, n).tolist() for n in LENGTHS]
    alone = [single(session, prompt, args.steps) for prompt in prompts]
    batch = batched(session, prompts, args.steps)
    pairs = [
        run for i in range(0, len(prompts), 2) for run in batched(session, prompts[i : i + 2], args.steps)
    ]
    padded = [batched(session, [prompt], args.steps, min_rows=2)[0] for prompt in prompts]
    for k, prompt in enumerate(prompts):
        same = all(np.array_equal(batch[k][1], other[k][1]) for other in (pairs, padded))
        print(f"prompt of {len(prompt):3d} tokens: batch vs single: {describe(alone[k], batch[k])}")
        print(
            f"    batch of {len(prompts)} vs pairs vs padded lone row: {'identical' if same else 'DIFFERENT'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
