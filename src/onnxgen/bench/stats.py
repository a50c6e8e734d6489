"""The statistics of ``onnxgen bench`` (parent side): medians and spreads of the measured runs of one
worker, the speculative-vs-plain pairing, and the token checks between engines."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

PLAN_KEYS = ("decode_plan_requested", "decode_plan", "decode_plan_reason")
# a worker's load: seconds of its engine's load call, resident MiB right after it, most resident MiB so far
LOAD_KEYS = ("load_s", "rss_load_mb", "peak_load_mb")


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def decode_rate(step_ms: Sequence[float], skip: int = 0) -> float:
    """Decode tokens per second over the steps after the first ``skip``."""
    steps = step_ms[skip:]
    total = sum(steps)
    return 1000.0 * len(steps) / total if total > 0 else 0.0


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ms_per_token(rate: float) -> float:
    return 1000.0 / rate if rate > 0 else float("inf")


def summarize(runs: Sequence[dict[str, Any]], skip: int, info: dict[str, Any]) -> dict[str, Any]:
    """Median/min/max of prefill, TTFT, decode rate and ms/token over the measured runs, plus the worker's
    facts: peak RSS and PSS after its last run, and (onnxgen) the decode plan that ran in it."""
    rates = [decode_rate(r["step_ms"], skip) for r in runs]
    last = runs[-1]
    summary: dict[str, Any] = {
        "prefill_ms": spread([r["prefill_ms"] for r in runs]),
        "ttft_ms": spread([r["ttft_ms"] for r in runs]),
        "decode_tok_s": spread(rates),
        "decode_ms_per_token": spread([_ms_per_token(rate) for rate in rates]),
        "peak_rss_mb": last["peak_rss_mb"],
        "rss_mb": last.get("rss_mb"),
        "pss_mb": last.get("pss_mb"),
        **{key: info.get(key) for key in LOAD_KEYS},
        "process_threads": info.get("process_threads"),
        "version": info.get("version"),
        "fast_ops": info.get("fast_ops"),
        "decode_fusions": info.get("decode_fusions"),
        "runs": [
            {"prefill_ms": r["prefill_ms"], "ttft_ms": r["ttft_ms"], "decode_tok_s": rate}
            for r, rate in zip(runs, rates, strict=True)
        ],
    }
    if all("total_ms" in r for r in runs):
        summary["total_ms"] = spread([r["total_ms"] for r in runs])
    summary.update({key: last[key] for key in PLAN_KEYS if key in last})
    return summary


def _tokens_per_forward(run: dict[str, Any]) -> float:
    forwards = run.get("target_forward_passes") or run.get("forward_passes") or 0
    return len(run["token_ids"]) / forwards if forwards else 0.0


def summarize_speculative(
    plain: Sequence[dict[str, Any]], spec: Sequence[dict[str, Any]], skip: int, mode: str, draft_tokens: int
) -> dict[str, Any]:
    """Speculative runs beside the plain runs of the same worker (run i of each made back to back).

    ``speedup`` is the median over pairs of plain / speculative end-to-end time (request call to last
    token, prefill included): above 1x speculation is faster. ``tokens_match`` checks every pair's tokens.
    """
    rates = [decode_rate(r["step_ms"], skip) for r in spec]
    plain_rates = [decode_rate(r["step_ms"], skip) for r in plain]
    divergence = next(
        (
            d
            for p, s in zip(plain, spec, strict=True)
            if (d := first_divergence(p["token_ids"], s["token_ids"])) is not None
        ),
        None,
    )
    last = spec[-1]
    proposed, accepted = last.get("proposed_draft_tokens", 0), last.get("accepted_draft_tokens", 0)
    return {
        "mode": mode,
        "draft_tokens": draft_tokens,
        "prefill_ms": spread([r["prefill_ms"] for r in spec]),
        "ttft_ms": spread([r["ttft_ms"] for r in spec]),
        "total_ms": spread([r["total_ms"] for r in spec]),
        "plain_total_ms": spread([r["total_ms"] for r in plain]),
        "decode_tok_s": spread(rates),
        "plain_decode_tok_s": spread(plain_rates),
        "tokens_per_target_forward": statistics.median(_tokens_per_forward(r) for r in spec),
        "plain_tokens_per_forward": statistics.median(_tokens_per_forward(r) for r in plain),
        "proposed_draft_tokens": proposed,
        "accepted_draft_tokens": accepted,
        "acceptance": accepted / proposed if proposed else 0.0,
        "target_forward_passes": last.get("target_forward_passes"),
        "state_replays": last.get("state_replays"),
        "speculation": last.get("speculation"),  # MTP auto's decision in the last run, if it decides
        "predicted_speedup": last.get("predicted_speedup"),
        "speedup": statistics.median(p["total_ms"] / s["total_ms"] for p, s in zip(plain, spec, strict=True)),
        "decode_speedup": statistics.median(rates) / statistics.median(plain_rates)
        if statistics.median(plain_rates) > 0
        else float("nan"),
        "tokens_match": divergence is None,
        "first_divergence": divergence,
        "peak_rss_mb": last["peak_rss_mb"],
    }


def pair_ratio(ours: float, theirs: float) -> float:
    """ours / theirs of one run pair; nan where the other engine recorded nothing (a zero rate)."""
    return ours / theirs if theirs > 0 else float("nan")


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median over run pairs (run i of each engine, made back to back) of ours / theirs, so that the
    machine's drift between pairs cancels."""
    return statistics.median(pair_ratio(a, b) for a, b in zip(ours, theirs, strict=True))


def ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """onnxgen / other engine of decode tok/s, TTFT and prefill: :func:`paired_ratio` of the runs."""

    def one(key: str) -> float:
        return paired_ratio([r[key] for r in ours["runs"]], [r[key] for r in theirs["runs"]])

    return {"decode_tok_s": one("decode_tok_s"), "ttft": one("ttft_ms"), "prefill": one("prefill_ms")}


def memory_ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """onnxgen / other engine of load time, resident memory after load, peak during load and resident
    memory after the runs (one value per worker; the medians over worker sets when pooled)."""
    pairs = {"load_s": "load_s", "rss_load": "rss_load_mb", "peak_load": "peak_load_mb", "rss": "rss_mb"}
    out = {}
    for name, key in pairs.items():
        a, b = ours.get(key), theirs.get(key)
        out[name] = pair_ratio(a, b) if a is not None and b is not None else float("nan")
    return out


def pooled_load(infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The median of each :data:`LOAD_KEYS` fact over worker sets (None where a worker did not report it)."""
    out: dict[str, Any] = {}
    for key in LOAD_KEYS:
        values = [i[key] for i in infos if i.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def token_check(tokens: dict[str, list[int]]) -> dict[str, Any]:
    """Whether every engine's greedy tokens equal the first engine's; where the first difference is."""
    names = list(tokens)
    ref = tokens[names[0]]
    diverged = {n: d for n in names[1:] if (d := first_divergence(ref, tokens[n])) is not None}
    return {
        "tokens_match": not diverged,
        "first_divergence": min(diverged.values()) if diverged else None,
        "diverging_engines": sorted(diverged),
    }


def summarize_constraint(
    plain: Sequence[dict[str, Any]], constrained: Sequence[dict[str, Any]], skip: int
) -> dict[str, Any]:
    """Constrained runs beside the plain runs of the same worker (run i of each made back to back).

    ``slowdown`` is the median over pairs of the constrained run's decode time per token over the plain
    run's, minus one (0.05: 5% slower); ``constraint_us_per_token`` is the constraint's own time per
    generated token (following the sequence, computing and applying masks) and ``constraint_share`` its
    median share of a constrained decode step; ``unmasked_share`` is the share of the last run's tokens
    chosen without a mask (greedy argmax the grammar surely allowed).
    """
    rates = [decode_rate(r["step_ms"], skip) for r in constrained]
    plain_rates = [decode_rate(r["step_ms"], skip) for r in plain]
    own = [1e6 * r["constraint_s"] / len(r["token_ids"]) for r in constrained]
    return {
        "decode_tok_s": spread(rates),
        "plain_decode_tok_s": spread(plain_rates),
        "slowdown": statistics.median(p / c - 1.0 for p, c in zip(plain_rates, rates, strict=True)),
        "constraint_us_per_token": spread(own),
        "constraint_share": statistics.median(u * r / 1e6 for u, r in zip(own, rates, strict=True)),
        "constraint_masks": constrained[-1].get("constraint_masks"),
        "constraint_unmasked": constrained[-1].get("constraint_unmasked"),
        "unmasked_share": constrained[-1].get("constraint_unmasked", 0)
        / max(1, len(constrained[-1]["token_ids"])),
        "peak_rss_mb": constrained[-1]["peak_rss_mb"],
    }
