"""Cold and warm loads of onnxgen against onnxruntime-genai's, each in a fresh process, rounds interleaved.

``python scripts/load_time.py MODEL_DIR [--rounds 5] [--threads 2] [--warm-only] [--tree LABEL=SRC ...]
[--first-token]``

Each round starts, in shuffled order, one process per case:

- ``onnxgen-cold``: ``onnxgen.load`` with an empty cache folder (``ONNXGEN_CACHE_DIR``): the graph passes run
  and the prepared graph is written;
- ``onnxgen-warm``: ``onnxgen.load`` with the cache the cold loads filled: no pass runs;
- ``genai``: ``og.Model`` and ``og.Tokenizer`` on the same folder with the same intra-op threads.

``--warm-only`` leaves the cold case out: each round is then one interleaved pair (onnxgen warm, genai).
``--tree LABEL=SRC`` (repeatable) runs onnxgen's cases once per source tree (``PYTHONPATH=SRC``), labelled
``onnxgen-warm[LABEL]``, all in the same rounds: two versions of onnxgen side by side with onnxruntime-genai.
``--first-token`` also times, right after the load, encoding a short text prompt and generating its first
token (what a lazily loaded part would move out of the load and into the first request).

Each process reports the seconds of its imports (onnxgen's engine modules; onnxruntime-genai and numpy)
and of its load call, resident MiB right after the load and the most resident MiB until then (and with
``--first-token`` the seconds to the first token after the load); the script prints the medians and the
onnxgen/genai ratios of each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_PROBE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
engine, model, threads, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
PROMPT = "The quick brown fox jumps over the lazy dog while the band plays on the old pier."
if engine == "genai":
    import numpy, onnxruntime_genai as og
    t1 = time.perf_counter()
    config = og.Config(model)
    config.clear_providers()
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    loaded = og.Model(config)
    tokenizer = og.Tokenizer(loaded)
else:
    import onnxgen
    import onnxgen.llm  # the engine's modules (``import onnxgen`` alone imports them on first use)
    t1 = time.perf_counter()
    loaded = onnxgen.load(model, threads=threads)
t2 = time.perf_counter()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out = {"import_s": t1 - t0, "load_s": t2 - t1, "rss_mb": rss, "peak_mb": peak}
if first:
    t3 = time.perf_counter()
    if engine == "genai":
        params = og.GeneratorParams(loaded)
        params.set_search_options(max_length=64)
        generator = og.Generator(loaded, params)
        generator.append_tokens(tokenizer.encode(PROMPT))
        generator.generate_next_token()
        generator.get_next_tokens()
    else:
        loaded.generate(PROMPT, max_new_tokens=1, ignore_eos=True)
    out["first_s"] = time.perf_counter() - t3
print(json.dumps(out))
"""

KEYS = ("import_s", "load_s", "rss_mb", "peak_mb")


def probe(
    engine: str, model: Path, threads: int, cache: Path | None, src: str | None = None, first: bool = False
) -> dict[str, float]:
    env = dict(os.environ)
    if cache is not None:
        env["ONNXGEN_CACHE_DIR"] = str(cache)
    if src is not None:
        env["PYTHONPATH"] = src
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, engine, str(model), str(threads), "1" if first else "0"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm-only", action="store_true", help="leave the cold loads out")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=SRC", help="an onnxgen source tree")
    p.add_argument("--first-token", action="store_true", help="also time the first token after the load")
    args = p.parse_args(argv)
    trees: dict[str, str | None] = dict(t.split("=", 1) for t in args.tree) or {"": None}
    root = Path(tempfile.mkdtemp(prefix="load-time-"))
    warm = root / "warm"
    kinds = ("warm",) if args.warm_only else ("cold", "warm")
    # case -> (engine, source tree); onnxgen's cases per tree, labelled with it where trees were given
    cases = {
        f"onnxgen-{k}" + (f"[{label}]" if label else ""): ("onnxgen", src)
        for label, src in trees.items()
        for k in kinds
    }
    cases["genai"] = ("genai", None)
    for src in trees.values():
        probe("onnxgen", args.model, args.threads, warm, src)  # fills the warm cache
    results: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
    try:
        for i in range(args.rounds):
            order = list(results)
            random.shuffle(order)
            for case in order:
                engine, src = cases[case]
                cache = (root / f"cold-{i}" if "-cold" in case else warm) if engine == "onnxgen" else None
                results[case].append(probe(engine, args.model, args.threads, cache, src, args.first_token))
                if cache is not None and "-cold" in case:
                    shutil.rmtree(cache, ignore_errors=True)
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, results)
    return 0


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> None:
    keys = KEYS + (("first_s", "load_first_s") if args.first_token else ())
    for runs in results.values():
        for r in runs:
            if "first_s" in r:
                r["load_first_s"] = r["load_s"] + r["first_s"]
    medians = {
        case: {k: statistics.median(r[k] for r in runs) for k in keys} for case, runs in results.items()
    }
    print(f"model: {args.model}  threads: {args.threads}  rounds: {args.rounds} (medians)")
    print(f"{'case':22} " + " ".join(f"{k:>12}" for k in keys))
    for case, m in medians.items():
        print(f"{case:22} " + " ".join(f"{m[k]:12.3f}" for k in keys))
    for case in (c for c in results if c != "genai"):
        ratios = " ".join(f"{k} {medians[case][k] / medians['genai'][k]:.3f}x" for k in keys)
        print(f"{case}/genai: {ratios}")
        # each round's cases ran within the same minute: the median of per-round ratios is less exposed
        # to a neighbour's load than the ratio of medians
        for k in ("load_s", "load_first_s") if args.first_token else ("load_s",):
            paired = [a[k] / b[k] for a, b in zip(results[case], results["genai"], strict=True)]
            print(f"{case}/genai {k}, median of per-round ratios: {statistics.median(paired):.3f}x")
    onnxgen_cases = [c for c in results if c != "genai"]
    for case in onnxgen_cases[1:] if len(onnxgen_cases) > 1 and args.tree else ():
        base = onnxgen_cases[0]
        for k in ("load_s", "load_first_s") if args.first_token else ("load_s",):
            paired = [a[k] / b[k] for a, b in zip(results[case], results[base], strict=True)]
            print(f"{case}/{base} {k}, median of per-round ratios: {statistics.median(paired):.3f}x")
    print(json.dumps({"model": str(args.model), "threads": args.threads, "runs": results}))


if __name__ == "__main__":
    sys.exit(main())
