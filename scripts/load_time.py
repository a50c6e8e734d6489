"""Cold and warm loads of onnxgen against onnxruntime-genai's, each in a fresh process, rounds interleaved.

``python scripts/load_time.py MODEL_DIR [--rounds 5] [--threads 2] [--warm-only]``

Each round starts, in shuffled order, one process per case:

- ``onnxgen-cold``: ``onnxgen.load`` with an empty cache folder (``ONNXGEN_CACHE_DIR``): the graph passes run
  and the prepared graph is written;
- ``onnxgen-warm``: ``onnxgen.load`` with the cache the cold loads filled: no pass runs;
- ``genai``: ``og.Model`` and ``og.Tokenizer`` on the same folder with the same intra-op threads.

``--warm-only`` leaves the cold case out: each round is then one interleaved pair (onnxgen warm, genai).

Each process reports the seconds of its imports (onnxgen's engine modules; onnxruntime-genai and numpy)
and of its load call, resident MiB right after the load and the most resident MiB until then; the script
prints the medians and the onnxgen/genai ratios of each.
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
engine, model, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
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
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rss_mb": rss, "peak_mb": peak}))
"""

KEYS = ("import_s", "load_s", "rss_mb", "peak_mb")


def probe(engine: str, model: Path, threads: int, cache: Path | None) -> dict[str, float]:
    env = dict(os.environ)
    if cache is not None:
        env["ONNXGEN_CACHE_DIR"] = str(cache)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, engine, str(model), str(threads)],
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
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="load-time-"))
    warm = root / "warm"
    probe("onnxgen", args.model, args.threads, warm)  # fills the warm cache
    cases = ("onnxgen-warm", "genai") if args.warm_only else ("onnxgen-cold", "onnxgen-warm", "genai")
    results: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
    try:
        for i in range(args.rounds):
            order = list(results)
            random.shuffle(order)
            for case in order:
                cache = {"onnxgen-cold": root / f"cold-{i}", "onnxgen-warm": warm}.get(case)
                results[case].append(probe(case.split("-")[0], args.model, args.threads, cache))
                if cache is not None and case.endswith("cold"):
                    shutil.rmtree(cache, ignore_errors=True)
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {
        case: {k: statistics.median(r[k] for r in runs) for k in KEYS} for case, runs in results.items()
    }
    print(f"model: {args.model}  threads: {args.threads}  rounds: {args.rounds} (medians)")
    print(f"{'case':14} {'import s':>9} {'load s':>8} {'RSS MB':>8} {'peak MB':>8}")
    for case, m in medians.items():
        print(f"{case:14} {m['import_s']:9.2f} {m['load_s']:8.2f} {m['rss_mb']:8.0f} {m['peak_mb']:8.0f}")
    for case in (c for c in ("onnxgen-cold", "onnxgen-warm") if c in results):
        ratios = " ".join(f"{k} {medians[case][k] / medians['genai'][k]:.2f}x" for k in KEYS)
        print(f"{case}/genai: {ratios}")
        # each round's cases ran within the same minute: the median of per-round ratios is less exposed
        # to a neighbour's load than the ratio of medians
        paired = [a["load_s"] / b["load_s"] for a, b in zip(results[case], results["genai"], strict=True)]
        print(f"{case}/genai load s, median of per-round ratios: {statistics.median(paired):.2f}x")
    print(json.dumps({"model": str(args.model), "threads": args.threads, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
