"""Where a batched decode step spends its time: per-row cost of 1-, 2-, 4-, 8-row steps, per operator.

``python scripts/batch_profile.py MODEL_DIR [--threads 2] [--rows 1,2,4,8] [--prompt 64] [--steps 12]
[--rounds 3] [--chunks 16,64,256] [--accuracy-levels 4,1] [--profile]``

Runs the decode steps through the server's path (:class:`onnxgen.runtime.batch.BatchState`): ``n`` rows,
each a copy of one prefilled prompt, step after step. Row counts take turns within each round (the machine
may be shared), and every figure is the median over rounds of the median step. Prints per row count the
step's wall time, its time per row, the time inside onnxruntime (``run_with_iobinding``) and the rest (the
Python binding and copying around it); then the cost of a prefill chunk of each size against one 8-row
step. ``--accuracy-levels`` runs the int4 ``MatMulNBits`` nodes at each given ``accuracy_level`` (a copy of
the graph that maps the same weights: 4 quantizes activations to int8, 0/1 keeps them fp32). ``--profile``
runs onnxruntime's per-operator profile instead, each variant's session alone, row counts in turn for
``--rounds`` rounds: per op type the kernel time of the median step and the sum of each node's fastest
time over the steps. On a shared machine a node's kernel time is either near its fastest or longer by
a scheduler slice (the op waits for a descheduled thread of its pool), so the second figure is what
the step's arithmetic and memory traffic cost, and the gap between them is waiting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx


def with_accuracy_level(model: Path, level: int, folder: Path) -> Path:
    """A copy of ``model`` whose MatMulNBits nodes have ``accuracy_level`` ``level`` (weights linked)."""
    graph = onnx.load(str(model / "model.onnx"), load_external_data=False)
    for node in graph.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
                    break
            else:
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    out = folder / f"acc{level}"
    out.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.name != "model.onnx" and not (out / item.name).exists():
            (out / item.name).symlink_to(item)
    onnx.save(graph, str(out / "model.onnx"))
    return out


class Timed:
    """Wraps a session's ``run_with_iobinding`` to add up the seconds spent inside onnxruntime."""

    def __init__(self, session: object) -> None:
        self.inner = session.run_with_iobinding  # type: ignore[attr-defined]
        self.seconds = 0.0
        session.run_with_iobinding = self  # type: ignore[attr-defined]

    def __call__(self, *args: object) -> object:
        start = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.seconds += time.perf_counter() - start


def open_session(model: Path, threads: int, profile_prefix: str | None) -> object:
    from onnxgen.model import ModelPackage
    from onnxgen.runtime.graph_cache import session_graph
    from onnxgen.runtime.session import DecoderSession, make_session_options

    package = ModelPackage.open(model)
    opts = make_session_options(threads)
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return DecoderSession(
        session_graph(package.model_path, package.io, threads=threads),
        threads=threads,
        options=opts,
        verify=False,
    )


def token_ids(count: int, vocab: int) -> list[int]:
    """``count`` spread-out token ids below ``min(vocab, 1001)``."""
    return [(7919 * i + 13) % (min(vocab, 1001) - 1) + 1 for i in range(count)]


def time_steps(
    session: object, rows: int, prompt: list[int], steps: int, min_rows: int
) -> tuple[float, float]:
    """Median wall seconds and onnxruntime seconds of a decode step over ``rows`` rows."""
    from onnxgen.runtime.batch import BatchState

    state = session.new_state(len(prompt) + steps + 8)  # type: ignore[attr-defined]
    session.forward(state, np.array([prompt]), 1)  # type: ignore[attr-defined]
    batch = BatchState(session, rows, len(prompt) + steps + 8, min_rows)  # type: ignore[arg-type]
    for _ in range(rows):
        batch.admit(state)
    run = session.current()  # type: ignore[attr-defined]
    timer = Timed(run)
    walls, inside = [], []
    try:
        for t in range(steps + 2):
            timer.seconds = 0.0
            start = time.perf_counter()
            batch.step([prompt[(7 * t + r) % len(prompt)] for r in range(rows)])
            if t >= 2:  # two warm-up steps
                walls.append(time.perf_counter() - start)
                inside.append(timer.seconds)
    finally:
        del run.run_with_iobinding  # type: ignore[attr-defined]
    return statistics.median(walls), statistics.median(inside)


def time_chunk(session: object, tokens: int, repeats: int = 3) -> float:
    state = session.new_state(tokens + 2)  # type: ignore[attr-defined]
    ids = np.array([token_ids(tokens, session.vocab_size)])  # type: ignore[attr-defined]
    times = []
    for _ in range(repeats):
        state.reset()
        start = time.perf_counter()
        session.forward(state, ids, 1)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def node_runs(events: list[dict]) -> list[tuple[float, dict[tuple[str, str], float]]]:
    """Per ``model_run``: its wall time (us) and kernel time (us) per node, keyed by (op type, node name)."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = sorted(
        (e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
        key=lambda e: e["ts"],
    )
    out = []
    i = 0
    for run in runs:
        per_node: dict[tuple[str, str], float] = defaultdict(float)
        end = run["ts"] + run["dur"]
        while i < len(nodes) and nodes[i]["ts"] < end:
            event = nodes[i]
            if event["ts"] >= run["ts"]:
                per_node[(event["args"].get("op_name", "?"), event["name"])] += event["dur"]
            i += 1
        out.append((float(run["dur"]), dict(per_node)))
    return out


def decode_blocks(
    runs: list[tuple[float, dict[tuple[str, str], float]]], row_order: list[int], steps: int
) -> dict[int, list[tuple[float, dict[tuple[str, str], float]]]]:
    """The timed decode steps of each row count (over every round), from runs in the order they ran: per
    :func:`time_steps` call one prefill, then ``steps + 2`` decode steps, the first two warming up."""
    blocks: dict[int, list[tuple[float, dict[tuple[str, str], float]]]] = defaultdict(list)
    i = 0
    for rows in row_order:
        blocks[rows].extend(runs[i + 3 : i + steps + 3])
        i += steps + 3
    return blocks


def op_table(
    block: list[tuple[float, dict[tuple[str, str], float]]],
) -> tuple[dict[str, float], dict[str, float], float]:
    """Per op type over the steps of one row count: kernel us of the median step, and the sum over its
    nodes of each node's fastest time (what the step costs when no thread waits on a descheduled one: on
    a shared machine a node's time is either near its fastest or a scheduler slice longer); and the
    median forward wall us."""
    names = {name for _, per in block for name in per}
    median: dict[str, float] = defaultdict(float)
    floor: dict[str, float] = defaultdict(float)
    for name in names:
        times = [per.get(name, 0.0) for _, per in block]
        floor[name[0]] += min(times)
    for op in {name[0] for name in names}:
        median[op] = statistics.median(sum(t for name, t in per.items() if name[0] == op) for _, per in block)
    return dict(median), dict(floor), statistics.median(w for w, _ in block)


def print_profile(name: str, blocks: dict[int, list], rows: list[int]) -> None:
    tables = {n: op_table(blocks[n]) for n in rows}
    ops = sorted({op for t in tables.values() for op in t[0]}, key=lambda op: -tables[rows[-1]][0].get(op, 0))
    print(f"\n{name}: kernel ms per decode step by op type, median step / sum of each node's fastest")
    print(f"{'op':34}" + "".join(f"{f'{n} rows':>17}" for n in rows))
    for op in ops:
        print(
            f"{op:34}"
            + "".join(f"{t[0].get(op, 0) / 1e3:8.1f} /{t[1].get(op, 0) / 1e3:7.1f}" for t in tables.values())
        )
    print(
        f"{'kernels (sum)':34}"
        + "".join(
            f"{sum(t[0].values()) / 1e3:8.1f} /{sum(t[1].values()) / 1e3:7.1f}" for t in tables.values()
        )
    )
    print(f"{'forward (wall, median)':34}" + "".join(f"{t[2] / 1e3:17.1f}" for t in tables.values()))
    one = sum(tables[rows[0]][1].values())
    print(
        f"{'fastest sum vs 1 row':34}"
        + "".join(f"{sum(t[1].values()) / one:16.2f}x" for t in tables.values())
    )


def profile(variants: dict[str, Path], args: argparse.Namespace, rows: list[int], folder: Path) -> None:
    """Per-operator profiles, one session at a time, row counts in turn for ``args.rounds`` rounds."""
    for name, path in variants.items():
        session = open_session(path, args.threads, str(folder / f"profile-{len(name)}"))
        prompt = token_ids(args.prompt, session.vocab_size)  # type: ignore[attr-defined]
        order = []
        for _ in range(args.rounds):
            for n in rows:
                time_steps(session, n, prompt, args.steps, args.min_rows)
                order.append(n)
        events = json.loads(Path(session.session.end_profiling()).read_text())  # type: ignore[attr-defined]
        del session
        print_profile(name, decode_blocks(node_runs(events), order, args.steps), rows)


def timing(variants: dict[str, Path], args: argparse.Namespace, rows: list[int], chunks: list[int]) -> None:
    """Step and prefill-chunk times, variants and row counts in turn for ``args.rounds`` rounds."""
    sessions = {name: open_session(path, args.threads, None) for name, path in variants.items()}
    prompt = token_ids(args.prompt, next(iter(sessions.values())).vocab_size)  # type: ignore[attr-defined]
    results: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    chunk_times: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.rounds):
        for name, session in sessions.items():  # variants and row counts take turns
            for n in rows:
                results[name][n].append(time_steps(session, n, prompt, args.steps, args.min_rows))
            for c in chunks:
                chunk_times[name][c].append(time_chunk(session, c))
    print(
        f"model {args.model}, {args.threads} threads, {args.prompt}-token rows, medians of {args.rounds} rounds"
    )
    for name in sessions:
        print(f"\n{name}")
        print(
            f"{'rows':>5} {'step ms':>9} {'ms/row':>8} {'vs 1 row':>9} {'in ORT ms':>10} {'outside ms':>11}"
        )
        one = statistics.median(w for w, _ in results[name][rows[0]])
        for n in rows:
            wall = statistics.median(w for w, _ in results[name][n])
            ort_s = statistics.median(s for _, s in results[name][n])
            print(
                f"{n:5d} {wall * 1e3:9.1f} {wall * 1e3 / n:8.2f} {wall / one:8.2f}x "
                f"{ort_s * 1e3:10.1f} {(wall - ort_s) * 1e3:11.2f}"
            )
        for c in chunks:
            chunk = statistics.median(chunk_times[name][c])
            print(f"prefill chunk of {c:4d} tokens: {chunk * 1e3:8.1f} ms ({chunk * 1e3 / c:.2f} ms/token)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of each row")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per row count and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunks", default="16,64,256", help="prefill chunk sizes to time ('' for none)")
    p.add_argument("--accuracy-levels", default="", help="int4 MatMulNBits accuracy levels to compare")
    p.add_argument("--min-rows", type=int, default=1, help="pad every step to this many rows")
    p.add_argument("--profile", action="store_true", help="per-operator profile of each row count")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    chunks = [int(c) for c in args.chunks.split(",") if c]
    folder = Path(tempfile.mkdtemp(prefix="batch-profile-"))
    variants = {"as exported": args.model}
    for level in [int(x) for x in args.accuracy_levels.split(",") if x]:
        variants[f"accuracy_level {level}"] = with_accuracy_level(args.model, level, folder)
    if args.profile:
        profile(variants, args, rows, folder)
    else:
        timing(variants, args, rows, chunks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
