"""Pool the reports of several ``onnxgen bench --compare ENGINE --json`` commands into one row per cell.

    python -m onnxgen.bench.pool REPORT.json [REPORT.json ...] [--level 0.9]

One benchmark command pairs each onnxgen run with a run of the other engine made right after it, in a few
fresh worker sets. On a shared machine two commands of the same cell can differ by more than the engines
do (where a process's memory landed, what the neighbours ran that minute), so a cell's ratio is best read
from several commands together: this pools the run pairs of every report of the same cell (model,
threads, new tokens, prompt length) and gives

- the pooled medians of both engines' decode rates and TTFTs, and of the run-pair ratios (onnxgen / other,
  as the benchmark computes them);
- a bootstrap interval of the pooled decode ratio that resamples whole commands (so that what a command
  draws as a whole is counted as the noise it is, not as many independent pairs);
- the range of the worker sets' own decode ratios, and whether greedy tokens matched in every command.

Printed as Markdown rows in the README's table layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxgen.bench.stats import pair_ratio, paired_ratio

ONNXGEN = "onnxgen"


@dataclass
class Cell:
    """The pooled run pairs of one cell: one inner list per command."""

    model: str
    threads: int
    new_tokens: int
    prompt_tokens: int
    other: str
    decode: list[list[tuple[float, float]]] = field(default_factory=list)  # (onnxgen, other) tok/s
    ttft: list[list[tuple[float, float]]] = field(default_factory=list)  # (onnxgen, other) ms
    worker_sets: list[float] = field(default_factory=list)  # each worker set's own decode ratio
    tokens_match: list[bool] = field(default_factory=list)

    @property
    def commands(self) -> int:
        return len(self.decode)

    @property
    def pairs(self) -> int:
        return sum(len(c) for c in self.decode)

    def decode_ratio(self) -> float:
        return _median_ratio(self.decode)

    def ttft_ratio(self) -> float:
        return _median_ratio(self.ttft)

    def decode_interval(
        self, level: float = 0.9, resamples: int = 4000, seed: int = 0
    ) -> tuple[float, float]:
        """A ``level`` bootstrap interval of :meth:`decode_ratio`, resampling whole commands."""
        return command_interval(
            [[pair_ratio(a, b) for a, b in c] for c in self.decode], level, resamples, seed
        )


def _median_ratio(groups: Sequence[Sequence[tuple[float, float]]]) -> float:
    pairs = [p for g in groups for p in g]
    return paired_ratio([a for a, _ in pairs], [b for _, b in pairs])


def command_interval(
    groups: Sequence[Sequence[float]], level: float = 0.9, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """The central ``level`` interval of the median of the pooled values when the groups (commands) are
    drawn with replacement; a single group gives the point itself at both ends."""
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level}")
    groups = [list(g) for g in groups if len(g)]
    if not groups:
        raise ValueError("no values to pool")
    if len(groups) == 1:
        point = float(statistics.median(groups[0]))
        return point, point
    rng = np.random.default_rng(seed)
    medians = np.empty(resamples)
    for i, picks in enumerate(rng.integers(0, len(groups), size=(resamples, len(groups)))):
        medians[i] = np.median(np.concatenate([groups[p] for p in picks]))
    tail = (1 - level) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return float(low), float(high)


def _other_engine(report: dict[str, Any], source: str) -> str:
    other = report.get("compare")
    if not other:
        raise ValueError(
            f"{source} compares no engine; pool reports of `onnxgen bench ... --compare ENGINE --json`"
        )
    return str(other)


def pool(reports: Iterable[tuple[str, dict[str, Any]]]) -> list[Cell]:
    """The cells of ``reports`` ((source name, parsed JSON) pairs), in the order they first appear."""
    cells: dict[tuple[str, int, int, int, str], Cell] = {}
    for source, report in reports:
        other = _other_engine(report, source)
        model = Path(str(report.get("model", "?"))).name
        for entry in report.get("results", []):
            engines = entry.get("engines", {})
            if ONNXGEN not in engines or other not in engines:
                raise ValueError(f"{source}: a result lacks the {ONNXGEN!r} or {other!r} runs")
            key = (
                model,
                int(report["threads"]),
                int(report["new_tokens"]),
                int(entry["prompt_tokens"]),
                other,
            )
            cell = cells.setdefault(key, Cell(*key))
            ours, theirs = engines[ONNXGEN]["runs"], engines[other]["runs"]
            if len(ours) != len(theirs) or not ours:
                raise ValueError(
                    f"{source}: {len(ours)} onnxgen runs against {len(theirs)} {other} runs at "
                    f"{entry['prompt_tokens']} prompt tokens; a comparison pairs every run"
                )
            cell.decode.append(
                [(a["decode_tok_s"], b["decode_tok_s"]) for a, b in zip(ours, theirs, strict=True)]
            )
            cell.ttft.append([(a["ttft_ms"], b["ttft_ms"]) for a, b in zip(ours, theirs, strict=True)])
            ratios = entry.get("process_decode_ratios", {})  # each worker set's, keyed by the onnxgen worker
            cell.worker_sets += ratios.get(ONNXGEN, [])
            cell.tokens_match.append(bool(entry.get("tokens_match")))
    return list(cells.values())


def _bold(text: str, good: bool) -> str:
    return f"**{text}**" if good else text


def markdown_rows(cells: Sequence[Cell], level: float = 0.9) -> list[str]:
    """README-style rows: export, prompt, both decode rates, the decode ratio with its interval, the worker
    sets' range, both TTFTs and their ratio, commands / run pairs, tokens equal in every command."""
    others = {c.other for c in cells}
    name = others.pop() if len(others) == 1 else "other engine"
    rows = [
        f"| export | prompt | onnxgen decode tok/s | {name} decode tok/s | decode ratio | {level:.0%} interval "
        f"(commands resampled) | per worker set | onnxgen TTFT ms | {name} TTFT ms | TTFT ratio "
        "| commands / pairs | tokens equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        low, high = c.decode_interval(level)
        decode, ttft = c.decode_ratio(), c.ttft_ratio()
        sets = f"{min(c.worker_sets):.2f}-{max(c.worker_sets):.2f}" if c.worker_sets else "-"
        rows.append(
            f"| {c.model} ({c.threads}T) | {c.prompt_tokens} "
            f"| {statistics.median(a for g in c.decode for a, _ in g):.1f} "
            f"| {statistics.median(b for g in c.decode for _, b in g):.1f} "
            f"| {_bold(f'{decode:.3f}x', decode >= 1)} | {low:.3f}-{high:.3f} | {sets} "
            f"| {statistics.median(a for g in c.ttft for a, _ in g):.1f} "
            f"| {statistics.median(b for g in c.ttft for _, b in g):.1f} "
            f"| {_bold(f'{ttft:.2f}x', ttft <= 1)} | {c.commands} / {c.pairs} "
            f"| {'yes' if all(c.tokens_match) else 'no'} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m onnxgen.bench.pool",
        description="Pool the reports of several `onnxgen bench --compare ENGINE --json` commands, one row per cell.",
    )
    parser.add_argument("reports", nargs="+", type=Path, help="JSON reports of `onnxgen bench --compare ...`")
    parser.add_argument("--level", type=float, default=0.9, help="interval coverage (default 0.9)")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.reports:
        try:
            loaded.append((str(path), json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: cannot read {path} as a bench report: {e}", file=sys.stderr)
            return 2
    try:
        print("\n".join(markdown_rows(pool(loaded), args.level)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyError as e:
        print(
            f"error: a report lacks the field {e}; pool the JSON of `onnxgen bench ... --json`",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
