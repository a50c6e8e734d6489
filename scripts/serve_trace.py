"""Where a loaded server's wall time went, from its step trace (``ONNXGEN_STEP_TRACE``, onnxgen.server.trace).

``python scripts/serve_trace.py TRACE.jsonl [--start T0 --end T1] [--clients C]``

Sums the worker's iterations that started in ``[T0, T1]`` (Unix seconds; default: the whole trace) into:
decode forwards by live rows, prefill forwards (and how many decode steps waited behind them), the
copies of states into and out of batch rows, the rest of the engine's step (token choice, detokenizing,
bookkeeping), taking requests and pushing deltas, and the worker's idle waits. With ``--clients C`` it also
counts the decode steps that ran fewer rows than C (ramp-up, ramp-down, clients between requests).
``scripts/load_test.py --trace FILE`` prints this table for each load level.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read(path: Path, start: float = 0.0, end: float = float("inf")) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if start <= r["t"] <= end]


def breakdown(
    records: Sequence[dict[str, Any]], wall: float, clients: int = 0
) -> list[tuple[str, float, str]]:
    """(what, seconds, note) rows that add up to ``wall`` (the last row: what no iteration accounts for)."""
    decode: dict[int, list[float]] = defaultdict(list)
    prefill_s = prefill_tokens = prefills = stalled = stalled_rows = 0
    copy = host = take = push = idle = 0.0
    short_steps = short_s = 0.0
    for r in records:
        forwards = r["fw"]
        in_step = 0.0
        prefilled = False
        for phase, rows, tokens, seconds in forwards:
            in_step += seconds
            if phase == "decode":
                decode[rows].append(seconds)
                if clients and rows < clients:
                    short_steps += 1
                    short_s += seconds
            else:
                prefill_s += seconds
                prefill_tokens += rows * tokens
                prefills += 1
                prefilled = True
        if prefilled and r["rows_in"]:
            stalled += 1
            stalled_rows += r["rows_in"]
        copy += r.get("copy", 0.0)
        host += r["step"] - in_step - r.get("copy", 0.0)
        take += r["take"]
        push += r["push"]
        idle += r["idle"]
    out = []
    for rows in sorted(decode):
        times = sorted(decode[rows])
        median = times[len(times) // 2] * 1000
        out.append((f"decode, {rows} rows", sum(times), f"{len(times)} steps, median {median:.0f} ms"))
    per_token = prefill_s / prefill_tokens * 1000 if prefill_tokens else 0.0
    note = f"{prefills} chunks, {prefill_tokens} tokens, {per_token:.1f} ms/token"
    out.append(("prefill", prefill_s, note))
    out.append(("", 0.0, f"decode steps stalled behind a prefill: {stalled} (rows waiting: {stalled_rows})"))
    out.append(("state copies (admit, retire)", copy, ""))
    out.append(("rest of the step (choice, detokenize, bookkeeping)", host, ""))
    out.append(("take requests, push deltas", take + push, ""))
    out.append(("worker idle (no work)", idle, ""))
    accounted = sum(seconds for _, seconds, _ in out)
    out.append(("outside the iterations", wall - accounted, ""))
    if clients:
        note = f"{short_steps:.0f} decode steps ran fewer than {clients} rows"
        out.append(("", short_s, note))
    return out


def table(rows: Sequence[tuple[str, float, str]], wall: float) -> str:
    lines = ["| where | s | share | note |", "|---|---:|---:|---|"]
    for what, seconds, note in rows:
        if not what:
            lines.append(f"| | {seconds:.1f} | | {note} |" if seconds else f"| | | | {note} |")
            continue
        lines.append(f"| {what} | {seconds:.1f} | {seconds / wall:.0%} | {note} |")
    lines.append(f"| wall | {wall:.1f} | 100% | |")
    return "\n".join(lines)


def report(path: Path, start: float, end: float, clients: int = 0) -> str:
    records = read(path, start, end)
    if not records:
        return f"no iterations in the trace {path} between {start} and {end}"
    if end == float("inf"):
        start, end = records[0]["t"] - records[0]["idle"], records[-1]["t"] + records[-1]["step"]
    return table(breakdown(records, end - start, clients), end - start)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--start", type=float, default=0.0, help="Unix seconds (default: the first iteration)")
    p.add_argument("--end", type=float, default=float("inf"), help="Unix seconds (default: the last)")
    p.add_argument("--clients", type=int, default=0, help="count decode steps with fewer rows than this")
    args = p.parse_args(argv)
    print(report(args.trace, args.start, args.end, args.clients))
    return 0


if __name__ == "__main__":
    sys.exit(main())
