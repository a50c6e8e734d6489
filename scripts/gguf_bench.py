"""One GGUF file on three engines: llama.cpp on the file itself, onnxgen on its conversion
(``onnxgen convert``), and onnxruntime-genai on the model builder's int4 export of the same weights.

    python scripts/gguf_bench.py FILE.gguf CONVERTED_DIR BUILDER_INT4_DIR [--threads 1,2] [--rounds 3]

Each (engine, threads, round) runs in a fresh process: load time, then greedy runs of ``--new-tokens`` new
tokens after prompts of 16 and 512 tokens (the same token ids for every engine, drawn from the vocabulary's
common range), one warm-up run first. Prints per engine and thread count the medians over rounds of decode
tok/s (tokens after the first), TTFT, load time and peak RSS. Needs llama-cpp-python and onnxruntime-genai.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

PROMPTS = (16, 512)


def _prompt(n: int) -> list[int]:
    return [1000 + (37 * i) % 20000 for i in range(n)]


def _worker(engine: str, path: str, threads: int, new_tokens: int) -> dict:
    start = time.perf_counter()
    if engine == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
        load_s = time.perf_counter() - start

        def run(prompt: list[int]) -> tuple[float, float]:
            llm.reset()
            t0 = time.perf_counter()
            stamps = []
            for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                stamps.append(time.perf_counter())
                if len(stamps) == new_tokens:
                    break
            return stamps[0] - t0, (len(stamps) - 1) / (stamps[-1] - stamps[0])
    elif engine == "onnxgen":
        import onnxgen

        llm = onnxgen.load(path, threads=threads)
        load_s = time.perf_counter() - start

        def run(prompt: list[int]) -> tuple[float, float]:
            res = llm.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True)
            return res.stats["ttft_s"], res.stats["decode_tok_s"]
    else:
        from onnxgen.bench.genai_engine import GenaiEngine

        llm = GenaiEngine(path, threads)
        load_s = time.perf_counter() - start

        def run(prompt: list[int]) -> tuple[float, float]:
            out = llm.run(prompt, new_tokens)
            steps = out["step_ms"]
            return out["ttft_ms"] / 1000, len(steps) / (sum(steps) / 1000)

    run(_prompt(16))  # warm-up
    result = {"load_s": load_s}
    for n in PROMPTS:
        ttft, rate = run(_prompt(n))
        result[f"ttft_{n}_ms"], result[f"tok_s_{n}"] = ttft * 1000, rate
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf")
    p.add_argument("converted")
    p.add_argument("builder_int4")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--worker", nargs=3, metavar=("ENGINE", "PATH", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        engine, path, threads = args.worker
        print(json.dumps(_worker(engine, path, int(threads), args.new_tokens)))
        return
    engines = [
        ("llama.cpp", args.gguf),
        ("onnxgen", args.converted),
        ("onnxruntime-genai", args.builder_int4),
    ]
    for threads in (int(t) for t in args.threads.split(",")):
        rows: dict[str, list[dict]] = {name: [] for name, _ in engines}
        for _ in range(args.rounds):  # engines interleaved round by round
            for name, path in engines:
                cmd = [sys.executable, __file__, "x", "x", "x", "--new-tokens", str(args.new_tokens)]
                out = subprocess.run(
                    [*cmd, "--worker", name, path, str(threads)], capture_output=True, text=True
                )
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed: {out.stderr[-2000:]}")
                rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"threads {threads}, {args.new_tokens} new tokens, medians of {args.rounds} processes")
        print("| engine | decode tok/s (16 / 512) | TTFT ms (16 / 512) | load s | peak RSS MB |")
        print("|---|---|---|---:|---:|")
        for name, results in rows.items():
            m = {k: statistics.median(r[k] for r in results) for k in results[0]}
            print(
                f"| {name} | {m['tok_s_16']:.1f} / {m['tok_s_512']:.1f} | {m['ttft_16_ms']:.0f} / "
                f"{m['ttft_512_ms']:.0f} | {m['load_s']:.2f} | {m['peak_rss_mb']:.0f} |"
            )


if __name__ == "__main__":
    main()
