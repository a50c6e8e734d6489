"""The plain-text tables of ``onnxgen bench``: one row per prompt and worker, the decode plans that ran,
and with ``--speculative`` a second table of speculative vs plain greedy decoding."""

from __future__ import annotations

from typing import Any

from onnxgen.bench.genai_engine import GENAI
from onnxgen.bench.onnxgen_engine import ONNXGEN
from onnxgen.generation.speculative.loop import MAX_DRAFT_FACTOR

COLUMNS = (
    "prompt",
    "tokens",
    "engine",
    "prefill ms",
    "TTFT ms",
    "decode tok/s",
    "ms/token",
    "min-max tok/s",
    "OS threads",
)
MEMORY_COLUMNS = (
    "prompt",
    "tokens",
    "engine",
    "load s",
    "RSS load MB",
    "peak load MB",
    "RSS MB",
    "peak RSS MB",
    "PSS MB",
)
SPEC_COLUMNS = (
    "prompt",
    "tokens",
    "engine",
    "plain tok/s",
    "spec tok/s",
    "tokens/forward",
    "drafts accepted",
    "replays",
    "plain ms",
    "spec ms",
    "speedup",
    "same tokens",
)
LEFT = (0, 2)  # columns aligned left (names); the rest are numbers


def _mb(value: float | None) -> str:
    return f"{value:.0f}" if value is not None else "?"


def _engine_row(entry: dict[str, Any], name: str, e: dict[str, Any]) -> list[str]:
    rate = e["decode_tok_s"]
    ms = e.get("decode_ms_per_token", {}).get("median")
    return [
        entry.get("prompt", ""),
        str(entry["prompt_tokens"]),
        name,
        f"{e['prefill_ms']['median']:.1f}",
        f"{e['ttft_ms']['median']:.1f}",
        f"{rate['median']:.1f}",
        f"{ms:.3f}" if ms is not None else "?",
        f"{rate['min']:.1f}-{rate['max']:.1f}",
        str(e.get("process_threads") or "?"),
    ]


def _memory_row(entry: dict[str, Any], name: str, e: dict[str, Any]) -> list[str]:
    load = e.get("load_s")
    return [
        entry.get("prompt", ""),
        str(entry["prompt_tokens"]),
        name,
        f"{load:.2f}" if load is not None else "?",
        _mb(e.get("rss_load_mb")),
        _mb(e.get("peak_load_mb")),
        _mb(e.get("rss_mb")),
        _mb(e.get("peak_rss_mb")),
        _mb(e.get("pss_mb")),
    ]


def _memory_ratio_row(label: str, r: dict[str, float]) -> list[str]:
    cells = ["", "", f"{label}/genai", *(f"{r[k]:.2f}x" for k in ("load_s", "rss_load", "peak_load", "rss"))]
    return cells + [""] * (len(MEMORY_COLUMNS) - len(cells))


def memory_lines(report: dict[str, Any]) -> list[str]:
    """Load time and memory per worker: right after load, the most during load, after the runs."""
    rows = [list(MEMORY_COLUMNS)]
    for entry in report["results"]:
        rows.extend(_memory_row(entry, name, e) for name, e in entry["engines"].items())
        for label, r in entry.get("memory_ratios", {}).items():
            rows.append(_memory_ratio_row(label, r))
    return [
        *_table(rows),
        "load s: the engine's load call; RSS load / peak load: resident MiB right after it / the most "
        "until then; RSS / peak RSS / PSS: after the runs (medians over worker sets where pooled)",
    ]


def _ratio_row(label: str, r: dict[str, float]) -> list[str]:
    cells = [
        "",
        "",
        f"{label}/genai",
        f"{r['prefill']:.2f}x",
        f"{r['ttft']:.2f}x",
        f"{r['decode_tok_s']:.2f}x",
    ]
    return cells + [""] * (len(COLUMNS) - len(cells))


def _spec_row(entry: dict[str, Any], name: str, s: dict[str, Any]) -> list[str]:
    same = "yes" if s["tokens_match"] else f"no (from {s['first_divergence']})"
    return [
        entry.get("prompt", ""),
        str(entry["prompt_tokens"]),
        name,
        f"{s['plain_decode_tok_s']['median']:.1f}",
        f"{s['decode_tok_s']['median']:.1f}",
        f"{s['tokens_per_target_forward']:.2f}",
        f"{s['accepted_draft_tokens']}/{s['proposed_draft_tokens']}",
        str(s.get("state_replays", 0)),
        f"{s['plain_total_ms']['median']:.1f}",
        f"{s['total_ms']['median']:.1f}",
        f"{s['speedup']:.2f}x",
        same,
    ]


def _align(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(w) if i in LEFT else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    table = _align(rows)
    return [table[0], "-" * len(table[0]), *table[1:]]


def plan_lines(report: dict[str, Any]) -> list[str]:
    """Which decode plan each onnxgen worker asked for and ran (read after its runs), and why."""
    seen: dict[tuple[str, str, str, str], None] = {}
    for entry in report["results"]:
        for name, e in entry["engines"].items():
            if "decode_plan" in e:
                seen[
                    name,
                    e.get("decode_plan_requested", "auto"),
                    e["decode_plan"],
                    e.get("decode_plan_reason", ""),
                ] = None
    if not report.get("decode_plans"):
        return [f"decode plan: {ran} ({why})" for _, _, ran, why in seen]
    return ["decode plans (asked -> ran: why):"] + [
        f"  {name}: {asked} -> {ran}: {why}" for name, asked, ran, why in seen
    ]


def fast_ops_lines(report: dict[str, Any]) -> list[str]:
    """What the fast-ops pass (onnxgen.graph.hybrid_ops) and the decode fusions
    (onnxgen.graph.decode_fusions) did in the onnxgen workers, once per setting."""
    lines = []
    for key, label in (("fast_ops", "fast ops"), ("decode_fusions", "fusions")):
        seen = {e[key]: None for entry in report["results"] for e in entry["engines"].values() if e.get(key)}
        lines += [f"{label}: {what}" for what in seen]
    return lines


def _header(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    engines = report["results"][0]["engines"]
    ours = next(e for name, e in engines.items() if name.startswith(ONNXGEN))
    versions = [f"onnxgen {ours['version']}", f"onnxruntime {m['onnxruntime']}"]
    if report["compare"]:
        versions.append(f"{GENAI} {engines[GENAI]['version']}")
    load = "/".join(f"{x:.2f}" for x in m["loadavg_start"]), "/".join(f"{x:.2f}" for x in m["loadavg_end"])
    skip = f", first {report['decode_skip']} decode steps skipped" if report["decode_skip"] else ""
    sets = report.get("processes", 1)
    runs = (
        f"{report['runs'] * sets} runs ({report['runs']} in each of {sets} worker sets), each set"
        if sets > 1
        else f"{report['runs']} runs"
    )
    lines = [
        f"model:   {report['model']}",
        f"method:  greedy, {report['new_tokens']} new tokens, medians of {runs} "
        f"after {report['warmups']} warmup(s){skip}; {report['threads']} intra-op threads per worker",
        f"machine: {m['cpu']}, {m['cores_available']} cores available; load avg {load[0]} -> {load[1]}",
        f"versions: {', '.join(versions)}",
    ]
    if not report.get("decode_plans"):
        lines.extend(plan_lines(report))
    lines.extend(fast_ops_lines(report))
    return lines


def _token_note(entry: dict[str, Any]) -> str:
    first = next(iter(entry["engines"]))
    others = ", ".join(entry.get("diverging_engines") or ["another engine"])
    return (
        f"prompt {entry.get('prompt', '')} {entry['prompt_tokens']}: greedy tokens of {others} differ from "
        f"{first}'s from token {entry['first_divergence']} on"
    )


def speculative_lines(report: dict[str, Any]) -> list[str]:
    k = report["draft_tokens"]
    rows = [list(SPEC_COLUMNS)]
    for entry in report["results"]:
        rows.extend(
            _spec_row(entry, n, e["speculative"]) for n, e in entry["engines"].items() if "speculative" in e
        )
    decided = [
        f"  {entry.get('prompt', '')} {n}: speculation {s['speculation']}"
        + (f" (predicted {s['predicted_speedup']:.2f}x)" if s.get("predicted_speedup") else "")
        for entry in report["results"]
        for n, e in entry["engines"].items()
        if (s := e.get("speculative", {})).get("speculation")
    ]
    return [
        f"speculative: {report['speculative']}, {k} draft tokens to start (adapting between 1 and {MAX_DRAFT_FACTOR * k}); "
        "plain and speculative greedy runs alternate in one worker",
        *_table(rows),
        *(["auto (last run of each):", *decided] if decided else []),
        "tokens/forward: generated tokens per target forward (plain: 1.00); plain/spec ms: request to last "
        "token, prefill included; speedup: median of plain/spec ms over run pairs (> 1x: speculation is faster)",
    ]


CONSTRAINT_COLUMNS = (
    "prompt",
    "tokens",
    "engine",
    "constraint",
    "plain tok/s",
    "constrained tok/s",
    "slowdown",
    "constraint us/token",
    "share of step",
    "unmasked",
)


def constraint_lines(report: dict[str, Any]) -> list[str]:
    rows = [list(CONSTRAINT_COLUMNS)]
    for entry in report["results"]:
        for name, e in entry["engines"].items():
            for constraint, c in e.get("constraints", {}).items():
                rows.append(
                    [
                        entry.get("prompt", ""),
                        str(entry["prompt_tokens"]),
                        name,
                        constraint,
                        f"{c['plain_decode_tok_s']['median']:.1f}",
                        f"{c['decode_tok_s']['median']:.1f}",
                        f"{100 * c['slowdown']:+.1f}%",
                        f"{c['constraint_us_per_token']['median']:.0f}",
                        f"{100 * c['constraint_share']:.1f}%",
                        f"{100 * c.get('unmasked_share', 0.0):.0f}%",
                    ]
                )
    return [
        "constraints: plain and constrained greedy runs alternate in one worker (built-in constraints that "
        "cannot end early: onnxgen.bench.constraints)",
        *_table(rows),
        "slowdown: median over run pairs of constrained / plain decode time per token - 1; constraint "
        "us/token: its own time (following the sequence, computing and applying masks); share: of a "
        "constrained step; unmasked: tokens chosen without a mask (the greedy argmax, which the grammar "
        "surely allowed)",
    ]


def _process_lines(report: dict[str, Any]) -> list[str]:
    """Each worker set's decode-rate ratio, where several sets were pooled (``--processes``)."""
    if report.get("processes", 1) < 2:
        return []
    lines = [f"decode tok/s {ONNXGEN}/genai of each of the {report['processes']} worker sets (pooled above):"]
    for entry in report["results"]:
        for label, values in entry.get("process_decode_ratios", {}).items():
            ratios = " ".join(f"{v:.2f}x" for v in values)
            lines.append(f"  {entry['prompt']}/{entry['prompt_tokens']} {label}: {ratios}")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The report as plain aligned tables (medians; ratio rows are onnxgen / onnxruntime-genai)."""
    rows = [list(COLUMNS)]
    notes = []
    for entry in report["results"]:
        rows.extend(_engine_row(entry, name, e) for name, e in entry["engines"].items())
        ratios = entry.get("ratios") or ({ONNXGEN: entry["ratio"]} if "ratio" in entry else {})
        for label, r in ratios.items():
            rows.append(_ratio_row(label, r))
        if entry.get("tokens_match") is False:
            notes.append(_token_note(entry))
    lines = [*_header(report), "", *_table(rows)]
    if report["compare"]:
        lines.append("ratios > 1x: onnxgen is slower on prefill/TTFT and faster on decode tok/s")
        lines.extend(_process_lines(report))
    lines.extend(["", *memory_lines(report)])
    if report.get("decode_plans"):
        lines.extend(plan_lines(report))
    if report.get("speculative"):
        lines.extend(["", *speculative_lines(report)])
    if report.get("constraints"):
        lines.extend(["", *constraint_lines(report)])
    return "\n".join(lines + notes)
