"""``onnxgen bench [MODEL]``: prefill, TTFT, decode tok/s and peak RSS, optionally beside onnxruntime-genai.

The harness is :mod:`onnxgen.bench`; this module parses flags and prints the table (or ``--json``).
"""

from __future__ import annotations

import argparse
from typing import Any

from onnxgen.bench import ENGINES, GENAI, ONNXGEN, BenchConfig, run_bench, to_json
from onnxgen.cli_generate import MODEL_ENV, THREADS_ENV, resolve_model, resolve_threads
from onnxgen.runtime.session import default_threads


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 16,512 (got {text!r})"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one prompt length, e.g. 16,512")
    return values


def add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="time greedy generation (optionally beside onnxruntime-genai)",
        description="Greedy generation of exactly --new-tokens tokens from a synthetic prompt of each "
        "--prompt-tokens length, each engine in its own worker process with the same thread count.",
    )
    p.add_argument(
        "model", nargs="?", help=f"model directory (default: ${MODEL_ENV}, then the bundled model)"
    )
    p.add_argument(
        "--prompt-tokens", type=_int_list, default=(16, 512), metavar="N[,N...]", help="default 16,512"
    )
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    p.add_argument("--warmups", type=int, default=1, help="untimed runs per engine first (default 1)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per engine (default 5)")
    p.add_argument(
        "--decode-skip", type=int, default=0, metavar="N", help="leave the first N decode steps out"
    )
    p.add_argument(
        "--threads",
        type=int,
        help=f"intra-op threads for every engine (env {THREADS_ENV}; default: all cores)",
    )
    p.add_argument("--compare", choices=[e for e in ENGINES if e != ONNXGEN], help="also run this engine")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    threads = resolve_threads(args.threads) or default_threads()
    cfg = BenchConfig(
        model=str(resolve_model(args.model)),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        warmups=args.warmups,
        runs=args.runs,
        decode_skip=args.decode_skip,
        threads=threads,
        compare=args.compare,
    )
    report = run_bench(cfg)
    print(to_json(report) if args.json else format_report(report))
    return 0


# -- table ----------------------------------------------------------------------------------------
COLUMNS = (
    "prompt",
    "engine",
    "prefill ms",
    "TTFT ms",
    "decode tok/s",
    "min-max tok/s",
    "peak RSS MB",
    "OS threads",
)


def _engine_row(length: int, name: str, e: dict[str, Any]) -> list[str]:
    rate = e["decode_tok_s"]
    return [
        str(length),
        name,
        f"{e['prefill_ms']['median']:.1f}",
        f"{e['ttft_ms']['median']:.1f}",
        f"{rate['median']:.1f}",
        f"{rate['min']:.1f}-{rate['max']:.1f}",
        f"{e['peak_rss_mb']:.0f}" if e.get("peak_rss_mb") is not None else "?",
        str(e.get("process_threads") or "?"),
    ]


def _ratio_row(entry: dict[str, Any]) -> list[str]:
    r = entry["ratio"]
    return [
        "",
        "onnxgen/genai",
        f"{r['prefill']:.2f}x",
        f"{r['ttft']:.2f}x",
        f"{r['decode_tok_s']:.2f}x",
        "",
        "",
        "",
    ]


def _align(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(w) if i == 1 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _header(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    versions = [
        f"onnxgen {report['results'][0]['engines'][ONNXGEN]['version']}",
        f"onnxruntime {m['onnxruntime']}",
    ]
    if report["compare"]:
        versions.append(f"{GENAI} {report['results'][0]['engines'][GENAI]['version']}")
    load = "/".join(f"{x:.2f}" for x in m["loadavg_start"]), "/".join(f"{x:.2f}" for x in m["loadavg_end"])
    skip = f", first {report['decode_skip']} decode steps skipped" if report["decode_skip"] else ""
    return [
        f"model:   {report['model']}",
        f"method:  greedy, {report['new_tokens']} new tokens, medians of {report['runs']} runs "
        f"after {report['warmups']} warmup(s){skip}; {report['threads']} intra-op threads per engine",
        f"machine: {m['cpu']}, {m['cores_available']} cores available; load avg {load[0]} -> {load[1]}",
        f"versions: {', '.join(versions)}",
    ]


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain aligned table (medians; ratio rows are onnxgen / onnxruntime-genai)."""
    rows = [list(COLUMNS)]
    notes = []
    for entry in report["results"]:
        length = entry["prompt_tokens"]
        for name, e in entry["engines"].items():
            rows.append(_engine_row(length, name, e))
        if "ratio" in entry:
            rows.append(_ratio_row(entry))
            if not entry["tokens_match"]:
                notes.append(
                    f"prompt {length}: greedy tokens differ from token {entry['first_divergence']} on"
                )
    table = _align(rows)
    lines = [*_header(report), "", table[0], "-" * len(table[0]), *table[1:]]
    if report["compare"]:
        lines.append("ratios > 1x: onnxgen is slower on prefill/TTFT and faster on decode tok/s")
    return "\n".join(lines + notes)
