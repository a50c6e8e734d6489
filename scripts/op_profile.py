"""Where a prefill and a decode step spend their time, by operator, in onnxgen and onnxruntime-genai.

``python scripts/op_profile.py MODEL_DIR [--threads 2] [--prompt-tokens 512] [--steps 32] [--engine both]
[--warm 0]``

Both engines run the same greedy request with onnxruntime's profiler on (``SessionOptions.enable_profiling``;
onnxruntime-genai through its config's ``session_options.enable_profiling``). The profile's ``model_run``
events split it into forwards: the first is the prefill, the later ones are decode steps (the first two
steps are left out as warm-up). Prints, per operator type, the prefill's milliseconds and a decode step's
microseconds (the median step's share), and the kernels' sum against the forward's wall time (the rest is
onnxruntime's own work between kernels: allocation, thread hand-offs, binding).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np


def split_runs(events: list[dict]) -> list[tuple[float, dict[str, float]]]:
    """Per ``model_run``: its wall time (us) and kernel time per op type (us)."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = sorted(
        (e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
        key=lambda e: e["ts"],
    )
    out = []
    i = 0
    for run in runs:
        per_op: dict[str, float] = defaultdict(float)
        end = run["ts"] + run["dur"]
        while i < len(nodes) and nodes[i]["ts"] < end:
            if nodes[i]["ts"] >= run["ts"]:
                per_op[nodes[i]["args"].get("op_name", "?")] += nodes[i]["dur"]
            i += 1
        out.append((float(run["dur"]), dict(per_op)))
    return out


def onnxgen_profile(
    model: Path, threads: int, prompt: list[int], steps: int, folder: Path, warm: int = 0
) -> list:
    from onnxgen.model import ModelPackage
    from onnxgen.runtime.graph_cache import session_graph
    from onnxgen.runtime.session import DecoderSession, make_session_options

    package = ModelPackage.open(model)
    opts = make_session_options(threads)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(folder / "onnxgen")
    session = DecoderSession(
        session_graph(package.model_path, package.io, threads=threads),
        threads=threads,
        options=opts,
        verify=False,
    )
    for _ in range(warm):  # earlier requests (a prefill and a step each): the arena and its pages are warm
        warm_state = session.new_state(len(prompt) + 2)
        session.step(warm_state, int(session.forward(warm_state, np.array([prompt]), 1)[0, -1].argmax()))
    state = session.new_state(len(prompt) + steps + 1)
    logits = session.forward(state, np.array([prompt]), 1)[0, -1]
    for _ in range(steps):
        logits = session.step(state, int(logits.argmax()))
    path = session.session.end_profiling()
    return split_runs(json.loads(Path(path).read_text()))


def genai_profile(
    model: Path, threads: int, prompt: list[int], steps: int, folder: Path, warm: int = 0
) -> list:
    import onnxruntime_genai as og

    config = og.Config(str(model))
    config.clear_providers()
    options = {"intra_op_num_threads": threads, "enable_profiling": str(folder / "genai")}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    loaded = og.Model(config)
    for _ in range(warm):
        params = og.GeneratorParams(loaded)
        params.set_search_options(do_sample=False, max_length=len(prompt) + 2, min_length=len(prompt) + 2)
        gen = og.Generator(loaded, params)
        gen.append_tokens(np.asarray(prompt, dtype=np.int32))  # one forward: the prefill
        del gen
    params = og.GeneratorParams(loaded)
    total = len(prompt) + steps + 1
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    gen = og.Generator(loaded, params)
    gen.append_tokens(np.asarray(prompt, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    del gen, params, loaded  # the profile is written when the session closes
    files = sorted(glob.glob(str(folder / "genai*.json")), key=os.path.getmtime)
    return split_runs(json.loads(Path(files[-1]).read_text()))


def summarize(runs: list, skip: int = 0) -> tuple[float, dict[str, float], float, dict[str, float]]:
    """The prefill (the forward after the ``skip`` warm-up forwards) and the median decode step."""
    prefill_wall, prefill_ops = runs[skip]
    decode = runs[skip + 3 :]  # the first two steps warm up
    walls = [w for w, _ in decode]
    ops = sorted({op for _, per in decode for op in per})
    step_ops = {op: statistics.median(per.get(op, 0.0) for _, per in decode) for op in ops}
    return prefill_wall, prefill_ops, statistics.median(walls), step_ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--engine", choices=("both", "onnxgen", "genai"), default="both")
    p.add_argument(
        "--warm",
        type=int,
        default=0,
        help="requests of the same prompt before the profiled one (the first"
        " forwards of a session also fault in its activation memory)",
    )
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="op-profile-"))
    import onnxgen

    vocab = onnxgen.load(args.model, threads=1).session.vocab_size
    prompt = [1 + (7919 * i + 13) % (vocab - 1) for i in range(args.prompt_tokens)]
    results = {}
    if args.engine in ("both", "onnxgen"):
        runs = onnxgen_profile(args.model, args.threads, prompt, args.steps, folder, args.warm)
        results["onnxgen"] = summarize(runs, 2 * args.warm)
    if args.engine in ("both", "genai"):
        runs = genai_profile(args.model, args.threads, prompt, args.steps, folder, args.warm)
        results["genai"] = summarize(runs, args.warm)
    ops = sorted(
        {op for r in results.values() for op in (*r[1], *r[3])},
        key=lambda op: -max(r[1].get(op, 0) for r in results.values()),
    )
    names = list(results)
    print(
        f"model {args.model}, {args.threads} threads, prefill of {args.prompt_tokens} tokens after {args.warm}"
        " warm-up requests, decode steps from step 3"
    )
    print(
        f"{'op':34}"
        + "".join(f"{n + ' prefill ms':>22}" for n in names)
        + "".join(f"{n + ' step us':>20}" for n in names)
    )
    for op in ops:
        print(
            f"{op:34}"
            + "".join(f"{results[n][1].get(op, 0) / 1000:22.1f}" for n in names)
            + "".join(f"{results[n][3].get(op, 0):20.0f}" for n in names)
        )
    print(
        f"{'kernels (sum)':34}"
        + "".join(f"{sum(results[n][1].values()) / 1000:22.1f}" for n in names)
        + "".join(f"{sum(results[n][3].values()):20.0f}" for n in names)
    )
    print(
        f"{'forward (wall)':34}"
        + "".join(f"{results[n][0] / 1000:22.1f}" for n in names)
        + "".join(f"{results[n][2]:20.0f}" for n in names)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
