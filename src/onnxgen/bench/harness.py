"""Benchmark harness: greedy generation timed in one worker process per engine (or decode plan).

Each worker (onnxgen, one per ``decode_plans`` entry, and with ``compare`` onnxruntime-genai) is its own
subprocess, so peak RSS is per worker, with the same intra-op thread count. The parent sends JSON-line
commands on the worker's stdin and reads one JSON line per reply; runs are interleaved (worker 1 run 1,
worker 2 run 1, worker 1 run 2, ...) so slow drifts of a shared machine hit all alike. With
``speculative`` every onnxgen worker runs plain and speculative greedy generation back to back on the same
prompt (in alternating order), and the two are compared run by run; with ``constraints`` it runs plain
and constrained greedy generation the same way (:mod:`onnxgen.bench.constraints`), one variant per
constraint. A fresh set of workers serves each prompt, so its peak RSS belongs to that prompt.

Per run: ``prefill_ms`` (the prefill forward alone), ``ttft_ms`` (request call to first token),
``step_ms`` (one entry per later token), ``total_ms`` (request call to last token), ``token_ids``.
Prompts: :mod:`onnxgen.bench.prompts`; statistics: :mod:`onnxgen.bench.stats`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onnxgen.bench.constraints import constraint_kwargs
from onnxgen.bench.genai_engine import GENAI, BenchError, require_genai
from onnxgen.bench.onnxgen_engine import ENGINES, ONNXGEN, worker_main
from onnxgen.bench.prompts import NOVEL, PROMPT_KINDS, REPETITIVE, SYNTHETIC, kind_prompt, read_prompt_file
from onnxgen.bench.prompts import synthetic_prompt as synthetic_prompt
from onnxgen.bench.stats import (
    decode_rate,
    memory_ratio,
    paired_ratio,
    pooled_load,
    ratio,
    summarize,
    summarize_constraint,
    summarize_speculative,
    token_check,
)
from onnxgen.bench.worker import Worker, machine_info
from onnxgen.generation.speculative.spec import SpeculativeSpec, parse_speculative
from onnxgen.runtime.decode_routing import DECODE_PLANS

__all__ = [
    "ENGINES",
    "BenchConfig",
    "BenchError",
    "decode_rate",
    "run_bench",
    "synthetic_prompt",
    "worker_main",
]

Log = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    model: str
    prompt_tokens: tuple[int, ...] = (16, 512)
    new_tokens: int = 128
    warmups: int = 1
    runs: int = 5
    decode_skip: int = 0
    threads: int = 1
    compare: str | None = None
    decode_plans: tuple[str, ...] = ()  # one onnxgen worker per plan; () = one worker on the default (auto)
    speculative: str | None = None  # "prompt-lookup" or "draft:PATH"
    draft_tokens: int | None = None
    prompt_kinds: tuple[str, ...] | None = None  # None: see `kinds`
    prompt_files: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()  # built-in constraints (bench.constraints) timed beside plain runs
    processes: int = 1  # worker sets started one after another per prompt; their runs are pooled
    fast_ops: bool | None = None  # onnxgen workers' fast-ops pass (None: load()'s default)

    def __post_init__(self) -> None:
        if not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise ValueError(f"--prompt-tokens must be positive integers (got {list(self.prompt_tokens)})")
        if self.processes < 1:
            raise ValueError(f"--processes must be >= 1 (got {self.processes})")
        if self.new_tokens < 2:
            raise ValueError(
                f"--new-tokens must be >= 2 so there is a decode step to time (got {self.new_tokens})"
            )
        if self.runs < 1 or self.warmups < 0:
            raise ValueError(f"--runs must be >= 1 and --warmups >= 0 (got {self.runs}, {self.warmups})")
        if not 0 <= self.decode_skip < self.new_tokens - 1:
            raise ValueError(
                f"--decode-skip must be in [0, new_tokens - 1) = [0, {self.new_tokens - 1}) (got {self.decode_skip}); "
                "it drops that many of the new_tokens - 1 decode steps"
            )
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1 (got {self.threads})")
        if self.compare not in (None, GENAI):
            raise ValueError(f"--compare must be {GENAI!r} (got {self.compare!r})")
        self._check_lists()
        parse_speculative(self.speculative, self.draft_tokens)
        if self.constraints and self.speculative:
            raise ValueError("--constraint and --speculative time different things; give one of them")

    def _check_lists(self) -> None:
        for plan in self.decode_plans:
            if plan not in DECODE_PLANS or self.decode_plans.count(plan) > 1:
                raise ValueError(
                    f"--decode-plan {','.join(self.decode_plans)!r}: each entry must be one of "
                    f"{', '.join(DECODE_PLANS)}, listed once (got {plan!r})"
                )
        for name in self.constraints:
            constraint_kwargs(name)
            if self.constraints.count(name) > 1:
                raise ValueError(f"--constraint {','.join(self.constraints)!r}: {name!r} is listed twice")
        given = self.prompt_kinds or ()
        for kind in given:
            if kind not in PROMPT_KINDS or given.count(kind) > 1:
                raise ValueError(
                    f"--prompt-kind {','.join(self.prompt_kinds or ())!r}: each entry must be one of "
                    f"{', '.join(PROMPT_KINDS)}, listed once (got {kind!r})"
                )

    @property
    def spec(self) -> SpeculativeSpec | None:
        return parse_speculative(self.speculative, self.draft_tokens)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The built-in prompt kinds to run: as given; else none beside prompt files; else repetitive and
        novel when speculating (a synthetic prompt says little about drafting), synthetic otherwise."""
        if self.prompt_kinds is not None:
            return self.prompt_kinds
        if self.prompt_files:
            return ()
        return (REPETITIVE, NOVEL) if self.speculative else (SYNTHETIC,)


@dataclass(frozen=True)
class PromptCase:
    label: str  # the kind, or the prompt file's name
    length: int | None = None  # ids of a built-in kind; None: a file's text, used whole
    text: str | None = None


def prompt_cases(cfg: BenchConfig) -> list[PromptCase]:
    cases = [PromptCase(kind, n) for kind in cfg.kinds for n in cfg.prompt_tokens]
    return cases + [PromptCase(Path(f).name, None, read_prompt_file(f)) for f in cfg.prompt_files]


# -- one prompt ------------------------------------------------------------------------------------
def _start_workers(cfg: BenchConfig) -> list[Worker]:
    spec = cfg.spec
    options: dict[str, Any] = {
        "speculative": asdict(spec) if spec is not None else None,
        "fast_ops": cfg.fast_ops,
    }
    workers: list[Worker] = []
    try:
        for plan in cfg.decode_plans or ("",):
            label = f"{ONNXGEN}[{plan}]" if plan else ONNXGEN
            workers.append(
                Worker(ONNXGEN, cfg.model, cfg.threads, {**options, "decode_plan": plan or "auto"}, label)
            )
        if cfg.compare:
            workers.append(Worker(GENAI, cfg.model, cfg.threads))
    except BaseException:
        _close(workers)
        raise
    return workers


def _close(workers: list[Worker]) -> None:
    for worker in workers:
        worker.close()


def _prompts(cfg: BenchConfig, cases: list[PromptCase], ref: Worker) -> list[list[int]]:
    """Every case's prompt ids, each checked against the model's context before any run is measured (a
    prompt that does not fit fails the bench at once, not after the prompts before it were timed)."""
    return [_prompt(cfg, case, ref) for case in cases]


def _prompt(cfg: BenchConfig, case: PromptCase, ref: Worker) -> list[int]:
    try:
        if case.text is not None:
            ids = ref.encode(case.text, True)
        else:
            assert case.length is not None
            vocab = int(ref.info["vocab_size"])
            ids = kind_prompt(case.label, case.length, vocab, lambda text, special: ref.encode(text, special))
    except BenchError as e:
        raise BenchError(f"prompt {case.label}: {e}") from e
    context = ref.info.get("context_length")
    if context is not None and len(ids) + cfg.new_tokens > context:
        raise BenchError(
            f"prompt {case.label} of {len(ids)} tokens plus --new-tokens {cfg.new_tokens} exceeds the model's "
            f"context of {context} tokens; lower --prompt-tokens or --new-tokens"
        )
    return ids


PLAIN, SPECULATIVE = "plain", "speculative"  # run variants; a constraint's variant is its name


def _variants(cfg: BenchConfig, worker: Worker) -> tuple[str, ...]:
    if worker.engine != ONNXGEN:
        return (PLAIN,)
    return (PLAIN, SPECULATIVE) if cfg.speculative else (PLAIN, *cfg.constraints)


def _order(i: int, variants: tuple[str, ...]) -> tuple[str, ...]:
    """The variants of run ``i`` in rotated order, so none always runs first (or second)."""
    shift = i % len(variants)
    return variants[shift:] + variants[:shift]


def _run_once(worker: Worker, prompt: list[int], new_tokens: int, variant: str) -> dict[str, Any]:
    if variant == PLAIN:
        result = worker.run(prompt, new_tokens)
    elif variant == SPECULATIVE:
        result = worker.run(prompt, new_tokens, True)
    else:  # a constraint can end a run early only if its grammar completes: the built-in ones cannot
        result = worker.run(prompt, new_tokens, constraint=variant)
    if len(result["token_ids"]) != new_tokens:
        raise BenchError(
            f"{worker.label} ({variant}) generated {len(result['token_ids'])} tokens, not {new_tokens}"
        )
    return result


def _progress(cfg: BenchConfig, case: str, i: int, runs: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    if i < cfg.warmups:
        return f"prompt {case}: warmup {i + 1}/{cfg.warmups}"
    rates = ", ".join(
        f"{label}{'' if variant == PLAIN else ' ' + variant} {decode_rate(r[-1]['step_ms'], cfg.decode_skip):.1f} tok/s"
        for (label, variant), r in runs.items()
    )
    return f"prompt {case}: run {i + 1 - cfg.warmups}/{cfg.runs}: {rates}"


def _bench_case(
    cfg: BenchConfig, cases: list[PromptCase], index: int, known: list[list[int]], log: Log
) -> dict[str, Any]:
    """Bench ``cases[index]``; ``known`` holds every case's prompt ids once the first workers made them."""
    case, spec = cases[index], cfg.spec
    prompt: list[int] = []
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    per_process: list[dict[str, float]] = []  # each worker set's onnxgen / genai decode-rate ratios
    loads: dict[str, list[dict[str, Any]]] = {}  # each worker set's load facts, by worker label
    for p in range(cfg.processes):
        workers = _start_workers(cfg)
        try:
            if not known:
                known.extend(_prompts(cfg, cases, workers[0]))
            if not runs:
                prompt = known[index]
                runs = {(w.label, v): [] for w in workers for v in _variants(cfg, w)}
            name = f"{case.label}/{len(prompt)}" + (
                f" (processes {p + 1}/{cfg.processes})" if cfg.processes > 1 else ""
            )
            first = {key: len(r) for key, r in runs.items()}
            for i in range(cfg.warmups + cfg.runs):
                for worker in workers:
                    for variant in _order(i, _variants(cfg, worker)):
                        result = _run_once(worker, prompt, cfg.new_tokens, variant)
                        if i >= cfg.warmups:
                            runs[worker.label, variant].append(result)
                log(_progress(cfg, name, i, runs))
            infos = {w.label: w.info for w in workers}
            for w in workers:
                loads.setdefault(w.label, []).append(w.info)
            if cfg.compare:
                per_process.append(_process_ratios(cfg, workers, {k: r[first[k] :] for k, r in runs.items()}))
        finally:
            _close(workers)
    engines = {
        label: summarize(runs[label, PLAIN], cfg.decode_skip, {**info, **pooled_load(loads[label])})
        for label, info in infos.items()
    }
    for w in workers:
        plain = runs[w.label, PLAIN]
        if spec is not None and (w.label, SPECULATIVE) in runs:
            engines[w.label]["speculative"] = summarize_speculative(
                plain, runs[w.label, SPECULATIVE], cfg.decode_skip, spec.label, spec.draft_tokens
            )
        constrained = {c: runs[w.label, c] for c in cfg.constraints if (w.label, c) in runs}
        if constrained:
            engines[w.label]["constraints"] = {
                c: summarize_constraint(plain, r, cfg.decode_skip) for c, r in constrained.items()
            }
    entry: dict[str, Any] = {"prompt": case.label, "prompt_tokens": len(prompt), "engines": engines}
    if len(workers) > 1:
        entry.update(token_check({w.label: runs[w.label, PLAIN][0]["token_ids"] for w in workers}))
    if cfg.compare:
        ratios = {w.label: ratio(engines[w.label], engines[GENAI]) for w in workers if w.engine == ONNXGEN}
        entry["ratio"] = ratios[workers[0].label]
        entry["ratios"] = ratios
        entry["memory_ratios"] = {
            w.label: memory_ratio(engines[w.label], engines[GENAI]) for w in workers if w.engine == ONNXGEN
        }
        entry["process_decode_ratios"] = {label: [r[label] for r in per_process] for label in ratios}
    return entry


def _process_ratios(
    cfg: BenchConfig, workers: list[Worker], runs: dict[tuple[str, str], list[dict[str, Any]]]
) -> dict[str, float]:
    """One worker set's onnxgen / onnxruntime-genai decode-rate :func:`paired_ratio`, per onnxgen worker."""

    def rates(label: str) -> list[float]:
        return [decode_rate(r["step_ms"], cfg.decode_skip) for r in runs[label, PLAIN]]

    genai = rates(GENAI)
    return {w.label: paired_ratio(rates(w.label), genai) for w in workers if w.engine == ONNXGEN}


def _stderr_log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig, log: Log = _stderr_log) -> dict[str, Any]:
    """Run the benchmark described by ``cfg``; return the JSON-ready report."""
    if cfg.compare:
        require_genai()
    cases = prompt_cases(cfg)  # a bad prompt file fails here, before any worker starts
    machine = machine_info()
    known: list[list[int]] = []
    results = [_bench_case(cfg, cases, i, known, log) for i in range(len(cases))]
    machine["loadavg_end"] = list(os.getloadavg())
    spec = cfg.spec
    return {
        "model": str(cfg.model),
        "threads": cfg.threads,
        "new_tokens": cfg.new_tokens,
        "warmups": cfg.warmups,
        "runs": cfg.runs,
        "decode_skip": cfg.decode_skip,
        "compare": cfg.compare,
        "decode_plans": list(cfg.decode_plans),
        "speculative": spec.label if spec is not None else None,
        "draft_tokens": spec.draft_tokens if spec is not None else None,
        "constraints": list(cfg.constraints),
        "processes": cfg.processes,
        "machine": machine,
        "results": results,
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
