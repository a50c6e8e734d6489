"""In-process A/B of a decode-loop feature, on and off in shuffled order.

``python scripts/runtime_ab.py MODEL_DIR --feature lane|inplace|fast_ops|fuse|hidden|align [--threads 2] [--rounds 16]
[--prompt-tokens 16]``

One process loads the model (after a throwaway first session: the first onnxruntime session of a process
steps slower than later ones) and streams 128 greedy tokens (``min_new_tokens`` = all, as the benchmark
does) per variant and round, variants in shuffled order. Prints each variant's median ms per token, the
median over rounds of off / on (> 1: the feature is faster), the same for the time to first token, and
whether both produced the same tokens.

- ``lane``: steady decode steps through :meth:`DecoderSession.step`'s prepared lane, against steps that
  go through ``forward`` every time (lanes never made).
- ``inplace``: recurrent states updated in place in the steady cycle (``DecoderSession.inplace_states``),
  against double-buffered ones.
- ``fast_ops``: a hybrid's GatedRMSNorm and SiLU-fused CausalConvWithState on vectorized kernels
  (:mod:`onnxgen.graph.hybrid_ops`), against the export's ops (two sessions of the model, one per variant).
- ``fuse``: the decode fusions (:mod:`onnxgen.graph.decode_fusions`) against the graph without them (two
  sessions, made in random order: of two sessions in one process the later one may step a few % faster).
- ``hidden``: plain decoding of a model with an MTP head beside it, whose decoder therefore outputs its
  final hidden state (:mod:`onnxgen.graph.hidden_state`), against the same model loaded as if it had no
  head (two sessions, made in random order).
- ``align``: KV, state and input buffers on 64-byte boundaries (:func:`onnxgen.runtime.buffers.aligned_zeros`),
  against buffers 16 bytes past one, where numpy puts a large array (a fresh decode state per request; the
  session's persistent logits and step-input buffers keep the placement of the first request).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from unittest import mock

import numpy as np

import onnxgen
from onnxgen.prepare import MTPChoice
from onnxgen.runtime.session import DecoderSession

NEW_TOKENS = 128
SKIP = 4  # leading steps left out of each median


def switch(llm: onnxgen.LLM, feature: str) -> Callable[[bool], onnxgen.LLM]:
    """A function that turns ``feature`` on or off and returns the LLM to run the next request on."""
    session = llm.session
    if feature == "fast_ops":  # two sessions: the pass on (even where the default leaves it off) and off
        root = session._model_path.parent
        fast = onnxgen.load(root, threads=session.threads, fast_ops=True)
        if not fast.session.fast_ops.rewritten:
            raise SystemExit(f"{root} has no op that the fast-ops pass rewrites")
        exported = onnxgen.load(root, threads=session.threads, fast_ops=False)
        return lambda on: fast if on else exported
    if feature == "fuse":
        root = session._model_path.parent
        made = {}
        for on in random.sample([True, False], 2):
            made[on] = onnxgen.load(root, threads=session.threads, fuse=on)
        if not made[True].session.fusions.rewritten:
            raise SystemExit(f"{root} has nothing that the decode fusions merge")
        print(f"sessions made {'fused first' if next(iter(made)) else 'unfused first'}")
        return lambda on: made[on]
    if feature == "hidden":
        root = session._model_path.parent
        made = {}
        for on in random.sample([True, False], 2):
            headless = (
                contextlib.nullcontext()
                if on
                else mock.patch("onnxgen.prepare.find_mtp", lambda *args: MTPChoice(None, "left out"))
            )
            with headless:
                made[on] = onnxgen.load(root, threads=session.threads)
        if made[True].session.hidden_state is None:
            raise SystemExit(f"{root} has no MTP head (mtp.onnx), so its decoder outputs no hidden state")
        return lambda on: made[on]
    if feature == "lane":
        make = DecoderSession._lane

        def set_lane(on: bool) -> onnxgen.LLM:
            session._lane = (lambda *a: make(session, *a)) if on else (lambda *a: None)  # type: ignore[method-assign]
            llm.generator._state = None  # a fresh state: no lane made under the other setting
            return llm

        return set_lane
    if feature == "inplace":
        states = session.inplace_states
        if not states:
            raise SystemExit(f"{session._model_path} has no recurrent state that can be updated in place")

        def set_inplace(on: bool) -> onnxgen.LLM:
            session.inplace_states = states if on else frozenset()
            llm.generator._state = None  # states take the setting when they are made
            return llm

        return set_inplace
    if feature == "align":
        from onnxgen.runtime import buffers

        aligned = buffers._aligned

        def skewed(shape: tuple[int, ...], dtype: np.dtype, make: Callable) -> np.ndarray:
            dtype = np.dtype(dtype)
            raw = aligned((int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + 16,), np.uint8, make)
            return raw[16:].view(dtype).reshape(shape)

        def set_align(on: bool) -> onnxgen.LLM:
            buffers._aligned = aligned if on else skewed
            llm.generator._state = None  # the next request's state takes the placement
            return llm

        return set_align
    raise SystemExit(f"unknown feature {feature!r}; choose lane, inplace, fast_ops, fuse, hidden or align")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument(
        "--feature", required=True, choices=["lane", "inplace", "fast_ops", "fuse", "hidden", "align"]
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=16)
    args = p.parse_args()
    onnxgen.load(args.model, threads=args.threads)  # throwaway first session
    llm = onnxgen.load(args.model, threads=args.threads)
    prompt = [1 + (i * 7919 + 13) % 1000 for i in range(args.prompt_tokens)]
    params = onnxgen.SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.0)
    turn = switch(llm, args.feature)
    times: dict[bool, list[float]] = {True: [], False: []}
    firsts: dict[bool, list[float]] = {True: [], False: []}
    ratios, first_ratios, tokens = [], [], {}
    for _ in range(args.rounds):
        got, first = {}, {}
        for on in random.sample([True, False], 2):
            runner = turn(on)
            start = time.perf_counter()
            stamps, ids = [], []
            for event in runner.stream(prompt, params):
                stamps.append(time.perf_counter())
                ids.extend(event.token_ids)
            got[on] = statistics.median(np.diff(stamps)[SKIP:])
            first[on] = stamps[0] - start
            tokens[on] = ids
            times[on].append(got[on])
            firsts[on].append(first[on])
        ratios.append(got[False] / got[True])
        first_ratios.append(first[False] / first[True])
    on_ms, off_ms = (1e3 * statistics.median(times[v]) for v in (True, False))
    on_first, off_first = (1e3 * statistics.median(firsts[v]) for v in (True, False))
    print(
        f"{args.model}: {args.feature} on {on_ms:.3f} ms/token, off {off_ms:.3f} ms/token, "
        f"off/on {statistics.median(ratios):.3f}; first token on {on_first:.1f} ms, off {off_first:.1f} ms, "
        f"off/on {statistics.median(first_ratios):.3f}; {args.rounds} rounds, {len(prompt)}-token prompt; "
        f"same tokens: {tokens[True] == tokens[False]}"
    )


if __name__ == "__main__":
    main()
