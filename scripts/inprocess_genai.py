"""Where onnxgen's decode time goes against onnxruntime-genai's, both engines in one process.

``python scripts/inprocess_genai.py MODEL_DIR [--threads 1] [--rounds 16] [--prompt-tokens 16]``

One process holds onnxruntime-genai's model and onnxgen's session over the same export (after a
throwaway onnxgen session: the first onnxruntime session of a process steps a few percent slower than
later ones, which a separate-process benchmark cannot separate from the engine). Each round times, in
shuffled order, the median decode step of 128 greedy tokens (``min_new_tokens`` = all, as the
benchmark's onnxruntime-genai side uses ``min_length``) of:

- ``genai``: ``Generator.generate_next_token`` (its forward and token choice);
- ``stream``: ``LLM.stream`` (everything a user gets: processors, detokenizer, stop checks, events);
- ``forward``: ``DecoderSession.forward`` plus an argmax (onnxgen's runtime without the generation loop);
- ``bare`` (shared-KV exports): the same session run from a loop that only writes the token and
  position, binds the attention mask and takes the argmax, recurrent states ping-ponging between two
  bindings (what any Python loop pays).

Prints each variant's median ms/token and the median over rounds of genai's step time over the
variant's (> 1: faster than onnxruntime-genai). Needs onnxruntime-genai.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og

import onnxgen
from onnxgen.graph.logits_to_keep import LOGITS_TO_KEEP
from onnxgen.runtime.session import DecoderSession

NEW_TOKENS = 128
SKIP = 4  # leading steps left out of each median


def genai_variant(model: str, threads: int, prompt: list[int]) -> Callable[[], np.ndarray]:
    config = og.Config(model)
    config.clear_providers()
    opts = {"intra_op_num_threads": threads}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": opts}}}))
    genai_model = og.Model(config)
    total = len(prompt) + NEW_TOKENS

    def run() -> np.ndarray:
        params = og.GeneratorParams(genai_model)
        params.set_search_options(do_sample=False, max_length=total, min_length=total)
        generator = og.Generator(genai_model, params)
        generator.append_tokens(np.asarray(prompt, dtype=np.int32))
        generator.generate_next_token()
        stamps = [time.perf_counter()]
        while not generator.is_done():
            generator.generate_next_token()
            stamps.append(time.perf_counter())
        return np.diff(stamps)

    return run


def stream_variant(llm: onnxgen.LLM, prompt: list[int]) -> Callable[[], np.ndarray]:
    params = onnxgen.SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.0)

    def run() -> np.ndarray:
        stamps = [time.perf_counter() for _ in llm.stream(prompt, params)]
        return np.diff(stamps)

    return run


def forward_variant(session: DecoderSession, prompt: list[int]) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        state = session.new_state(len(prompt) + NEW_TOKENS)
        token = int(session.forward(state, np.array([prompt]), 1)[0, -1].argmax())
        stamps = [time.perf_counter()]
        for _ in range(NEW_TOKENS - 1):
            token = int(session.forward(state, np.array([[token]]), 1, copy=False)[0, -1].argmax())
            stamps.append(time.perf_counter())
        return np.diff(stamps)

    return run


def bare_variant(session: DecoderSession, prompt: list[int]) -> Callable[[], np.ndarray] | None:
    """A loop over the session's own onnxruntime session with everything bound once but the mask: two
    bindings, one per step parity, whose recurrent states ping-pong between two buffers."""
    io = session.io
    if io.attention_mask is None:
        return None
    capacity = len(prompt) + NEW_TOKENS
    ones = np.ones(capacity + 1, dtype=np.int64)
    masks = [ort.OrtValue.ortvalue_from_numpy(ones[:n].reshape(1, n)) for n in range(capacity + 1)]

    def run() -> np.ndarray:
        state = session.new_state(capacity)
        if not state.shared_kv:
            raise SystemExit("the bare loop needs a shared-KV (GroupQueryAttention) export")
        token = int(session.forward(state, np.array([prompt]), 1)[0, -1].argmax())
        ids = np.zeros((1, 1), dtype=np.int64)
        shape = (3, 1, 1) if io.position_ids_rank == 3 else (1, 1)
        positions = np.zeros(shape, dtype=np.int64)
        logits = np.empty((1, 1, session.vocab_size), dtype=np.float32)
        fixed = [(io.token_input, ids)] + ([(io.position_ids, positions)] if io.position_ids else [])
        if session.logits_to_keep:
            fixed.append((LOGITS_TO_KEEP, np.ones(1, dtype=np.int64)))
        ping = [slot.current.value for slot in state._slots]  # the states after the prompt
        pong = [ort.OrtValue.ortvalue_from_numpy(np.zeros(slot.shape, slot.dtype)) for slot in state._slots]
        bindings = []
        for src, dst in ((ping, pong), (pong, ping)):
            binding = session.session.io_binding()
            for name, array in fixed:
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
            for name, value in state._kv_io_in:  # the shared KV buffers, read and written in place
                binding.bind_ortvalue_input(name, value)
            for name, out in state._kv_io_out:
                binding.bind_ortvalue_output(name, out)
            for slot, a, b in zip(state._slots, src, dst, strict=True):
                binding.bind_ortvalue_input(slot.pair.input, a)
                binding.bind_ortvalue_output(slot.pair.output, b)
            binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(logits))
            bindings.append(binding)
        length = len(prompt)
        stamps = [time.perf_counter()]
        for step in range(NEW_TOKENS - 1):
            ids[0, 0] = token
            positions[...] = length
            length += 1
            binding = bindings[step % 2]
            binding.bind_ortvalue_input(io.attention_mask, masks[length])
            session.session.run_with_iobinding(binding)
            token = int(logits[0, -1].argmax())
            stamps.append(time.perf_counter())
        return np.diff(stamps)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=16)
    args = p.parse_args()
    prompt = [1 + (i * 7919 + 13) % 3000 for i in range(args.prompt_tokens)]
    throwaway = onnxgen.load(args.model, threads=args.threads)
    variants: dict[str, Callable[[], np.ndarray]] = {"genai": genai_variant(args.model, args.threads, prompt)}
    llm = onnxgen.load(args.model, threads=args.threads)
    del throwaway
    variants["stream"] = stream_variant(llm, prompt)
    variants["forward"] = forward_variant(llm.session, prompt)
    bare = bare_variant(llm.session, prompt)
    if bare is not None:
        variants["bare"] = bare
    for run in variants.values():
        run()  # warm-up
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants)
        random.Random(r).shuffle(order)
        for name in order:
            medians[name].append(float(np.median(variants[name]()[SKIP:])))
    print(f"{args.model}: {args.threads} thread(s), {args.rounds} rounds of {NEW_TOKENS} tokens")
    for name, values in medians.items():
        paired = statistics.median(g / v for g, v in zip(medians["genai"], values, strict=True))
        print(f"  {name:8s} {1e3 * statistics.median(values):7.3f} ms/token   genai/this {paired:.3f}")


if __name__ == "__main__":
    main()
