"""Decode's effective memory bandwidth against the machine's, measured in one run.

``python scripts/roofline.py MODEL_DIR [--threads 2] [--rounds 3] [--new-tokens 64] [--genai]``

A decode step reads every weight a token needs once, so ``weight bytes per token x tokens/s`` is the
bandwidth decoding draws; its share of what the machine's memory delivers (a STREAM-style copy and triad
over arrays far larger than the caches, torch on the same number of threads) says how much faster the
step could be. Bytes per token: every initializer of the session's graph (the prepared one: merged
projections as they run) except the embedding table, of which one row is read; KV reads are left out
(at the 16-token prompt used here they are a few hundred KB).

Rounds alternate: STREAM copy and triad, then onnxgen's greedy decode (and onnxruntime-genai's with
``--genai``, same model, same threads). Prints medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx

STREAM_MB = 512  # per array: far past any cache


def stream(threads: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` copy (2 arrays) and triad (3 arrays) bandwidth in GB/s, as STREAM counts them."""
    import torch

    torch.set_num_threads(threads)
    n = STREAM_MB * (1 << 20) // 8
    a, b, c = (torch.ones(n, dtype=torch.float64) for _ in range(3))
    best = {"copy": 0.0, "triad": 0.0}
    for _ in range(repeats):
        t = time.perf_counter()
        a.copy_(b)
        best["copy"] = max(best["copy"], 2 * 8 * n / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best["triad"] = max(best["triad"], 3 * 8 * n / (time.perf_counter() - t) / 1e9)
    return best


def bytes_per_token(graph: onnx.ModelProto) -> int:
    """Initializer bytes a decode step reads: all but the embedding table (one row of it)."""
    from onnxgen.model.external_data import location_of

    gathered = {n.input[0] for n in graph.graph.node if n.op_type == "Gather"}
    total = 0
    for t in graph.graph.initializer:
        size = int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if location_of(t):
            size = int(next(e.value for e in t.external_data if e.key == "length"))
        total += size // max(int(t.dims[0]), 1) if t.name in gathered and t.dims else size
    return total


def onnxgen_decode(llm: object, prompt: list[int], new_tokens: int) -> float:
    from onnxgen import SamplingParams

    params = SamplingParams(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0, detokenize=False
    )
    stamps = [time.perf_counter() for _ in llm.stream(prompt, params)]  # type: ignore[attr-defined]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def genai_decode(model: object, og: object, prompt: list[int], new_tokens: int) -> float:
    params = og.GeneratorParams(model)  # type: ignore[attr-defined]
    total = len(prompt) + new_tokens
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    gen = og.Generator(model, params)  # type: ignore[attr-defined]
    gen.append_tokens(np.asarray(prompt, dtype=np.int32))
    gen.generate_next_token()
    t0, n = time.perf_counter(), 0
    while not gen.is_done():
        gen.generate_next_token()
        n += 1
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--genai", action="store_true", help="also time onnxruntime-genai's decode")
    args = p.parse_args(argv)

    import onnxgen

    llm = onnxgen.load(args.model, threads=args.threads)
    graph = llm.session.prepared.load_graph()
    weight_bytes = bytes_per_token(graph)
    del graph
    genai = og = None
    if args.genai:
        import onnxruntime_genai as og

        config = og.Config(str(args.model))
        config.clear_providers()
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": args.threads}}}})
        )
        genai = og.Model(config)
    vocab = llm.session.vocab_size
    prompt = [1 + (7919 * i + 13) % (vocab - 1) for i in range(16)]
    onnxgen_decode(llm, prompt, 8)  # warm up
    if genai is not None:
        genai_decode(genai, og, prompt, 8)
    runs: dict[str, list[float]] = {"copy": [], "triad": [], "onnxgen": [], "genai": []}
    for i in range(args.rounds):
        for kind, value in stream(args.threads).items():
            runs[kind].append(value)
        runs["onnxgen"].append(onnxgen_decode(llm, prompt, args.new_tokens))
        if genai is not None:
            runs["genai"].append(genai_decode(genai, og, prompt, args.new_tokens))
        print(
            f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items() if v),
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    print(
        f"model {args.model}, {args.threads} threads, {weight_bytes / 1e6:.0f} MB of weights read per token"
    )
    print(f"STREAM copy {med['copy']:.1f} GB/s, triad {med['triad']:.1f} GB/s (medians of best-of-5)")
    for engine in ("onnxgen", "genai"):
        if engine in med:
            bw = weight_bytes * med[engine] / 1e9
            print(
                f"{engine}: {med[engine]:.1f} tok/s -> {bw:.1f} GB/s = {bw / med['copy']:.0%} of copy, "
                f"{bw / med['triad']:.0%} of triad"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
