"""Decode plans side by side: decode ms/token, prefill ms and peak memory of each plan, one process per run.

    .venv/bin/python scripts/bench_decode_plan.py MODEL_DIR [MODEL_DIR ...] [--plans scan,inline,auto]
        [--rounds 5] [--steps 64] [--prompt-len 32] [--threads N]

Every (model, plan, round) runs in a fresh process, rounds interleave the plans, so memory is measured per
plan and slow spells of a busy machine hit every plan alike. Per process: load, prefill, one warm decode step
(on the inline plan this builds the sibling), then ``--steps`` timed single-token steps. Reported per plan:
the median over rounds of each process's median step time (with the min-max of those medians), prefill,
the first decode step, peak RSS (VmHWM) and proportional set size (PSS: pages both sessions map count once).
Then a paired run (``--paired-rounds``): one process, one decode state, the two plans alternating in pairs
of steps, which is the robust speed comparison when other work shares the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _memory() -> dict[str, float]:
    out: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    rollup = Path("/proc/self/smaps_rollup")
    if rollup.is_file():
        for line in rollup.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "Pss":
                out["Pss"] = int(value.split()[0]) / 1024
    return out


def worker(model: str, plan: str, steps: int, prompt_len: int, threads: int | None) -> dict[str, object]:
    import numpy as np

    import onnxgen

    t0 = time.perf_counter()
    llm = onnxgen.load(model, threads=threads, decode_plan=plan)
    load_s = time.perf_counter() - t0
    session = llm.session
    vocab = session.vocab_size if session.vocab_size > 0 else 256
    prompt = (np.arange(prompt_len, dtype=np.int64) * 7 + 3) % vocab
    state = session.new_state(prompt_len + steps + 2)
    t0 = time.perf_counter()
    logits = session.forward(state, prompt[None])
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits = session.forward(state, np.array([[int(np.argmax(logits[0, -1]))]], dtype=np.int64))
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        token = np.array([[int(np.argmax(logits[0, -1]))]], dtype=np.int64)
        t0 = time.perf_counter()
        logits = session.forward(state, token)
        times.append(time.perf_counter() - t0)
    return {
        "plan": llm.decode_plan.plan.name,
        "reason": llm.decode_plan.choice.reason,
        "load_s": load_s,
        "prefill_ms": prefill_s * 1e3,
        "first_step_ms": first_s * 1e3,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        **_memory(),
    }


def paired(model: str, steps: int, rounds: int, threads: int | None) -> dict[str, object]:
    """Scan plan against inline plan on one decode state in one process, alternating in pairs of steps.

    Both plans run the same positions under the same machine load, so their ratio is the robust figure
    on a busy machine (separate processes differ by whatever else ran meanwhile)."""
    import numpy as np

    import onnxgen

    llm = onnxgen.load(model, threads=threads, decode_plan="inline")
    session, plan = llm.session, llm.session.plan
    vocab = session.vocab_size if session.vocab_size > 0 else 256
    times: dict[str, list[float]] = {"scan": [], "inline": []}
    for _ in range(rounds):
        state = session.new_state(32 + steps + 2)
        session.plan = plan
        logits = session.forward(state, (np.arange(32, dtype=np.int64)[None] * 7 + 3) % vocab)
        for i in range(steps):
            which = "scan" if (i // 2) % 2 == 0 else "inline"  # pairs keep both ping-pong bindings warm
            session.plan = None if which == "scan" else plan
            token = np.array([[int(np.argmax(logits[0, -1]))]], dtype=np.int64)
            t0 = time.perf_counter()
            logits = session.forward(state, token)
            if i >= 4:  # the first steps build the sibling and the bindings
                times[which].append(time.perf_counter() - t0)
        session.plan = plan
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "scan_ms": med["scan"],
        "inline_ms": med["inline"],
        "scans": len(llm.decode_plan.summary.inlinable),
    }


def run_one(model: str, plan: str, args: argparse.Namespace) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--worker", model, plan, str(args.steps), str(args.prompt_len)]
    cmd.append(str(args.threads or 0))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(model: str, plan: str, runs: list[dict[str, object]]) -> str:
    def med(key: str) -> float:
        return statistics.median(float(r[key]) for r in runs)  # type: ignore[arg-type]

    steps = [float(r["step_ms_median"]) for r in runs]  # type: ignore[arg-type]
    return (
        f"| {Path(model).name} | {plan} -> {runs[0]['plan']} | {med('step_ms_median'):.3f} "
        f"({min(steps):.3f}-{max(steps):.3f}) | {med('step_ms_mean'):.3f} | {med('prefill_ms'):.1f} | "
        f"{med('first_step_ms'):.1f} | {med('VmHWM'):.0f} | {med('Pss'):.0f} | {med('load_s'):.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--plans", default="scan,inline")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--paired-rounds", type=int, default=3, help="rounds of the paired A/B run (0: skip it)")
    args = p.parse_args(argv)
    plans = args.plans.split(",")
    print(
        "| model | plan (asked -> ran) | decode ms/token: median (min-max of rounds) | mean | prefill ms "
        "| first step ms | peak RSS MiB | PSS MiB | load s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        runs: dict[str, list[dict[str, object]]] = {plan: [] for plan in plans}
        for _ in range(args.rounds):
            for plan in plans:
                runs[plan].append(run_one(model, plan, args))
        for plan in plans:
            print(summarize(model, plan, runs[plan]), flush=True)
        for plan in plans:
            print(f"<!-- {Path(model).name} {plan}: {runs[plan][0]['reason']} -->", flush=True)
    if args.paired_rounds:
        print(
            "\n| model | paired: Scan plan ms/token | inline plan ms/token | saving per Scan us | inline/scan |"
        )
        print("|---|---|---|---|---|")
        for model in args.models:
            cmd = [sys.executable, __file__, "--paired", model, str(args.steps), str(args.paired_rounds)]
            cmd.append(str(args.threads or 0))
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
            r = json.loads(out.stdout.strip().splitlines()[-1])
            saving = (r["scan_ms"] - r["inline_ms"]) / r["scans"] * 1e3
            print(
                f"| {Path(model).name} | {r['scan_ms']:.3f} | {r['inline_ms']:.3f} | {saving:.1f} | "
                f"{r['inline_ms'] / r['scan_ms']:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--paired":
        model, steps, rounds, threads = sys.argv[2:6]
        print(json.dumps(paired(model, int(steps), int(rounds), int(threads) or None)))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model, plan, steps, prompt_len, threads = sys.argv[2:7]
        result = worker(model, plan, int(steps), int(prompt_len), int(threads) or None)
        print(json.dumps(result))
        sys.exit(0)
    sys.exit(main())
