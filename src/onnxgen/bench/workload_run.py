"""``onnxgen bench --workload``: the workloads of :mod:`onnxgen.bench.workloads` on each engine of
:mod:`onnxgen.bench.workload_engines`, round after round, and the table of what the client measured.

Per engine, workload and group of requests (``first``: the first request of a round, cold; ``later``: the
rest, which may reuse what the earlier ones left; ``all``), each round gives: TTFT p50 / p90 over its
requests; ITL p50 / p90 over the gaps between successive tokens as they arrive (tokens a server sends
together, as speculative decoding accepts them, arrive together); decode tok/s (tokens after the first
over the time from the first token to the last) and tok/s (all tokens over the requests' whole time). The
table shows each figure's median over the rounds.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onnxgen.bench.genai_engine import GENAI, BenchError
from onnxgen.bench.workload_engines import ENGINES, LLAMA_CPP, ONNXGEN, Engine, OnnxgenServer, Sample
from onnxgen.bench.workloads import DEFAULT_MAX_TOKENS, WORKLOADS, build

GROUPS = ("first", "later", "all")
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "decode_tok_s", "tok_s")


@dataclass
class WorkloadConfig:
    model: str
    threads: int
    workloads: tuple[str, ...] = WORKLOADS
    rounds: int = 3
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS of each workload
    server_flags: tuple[tuple[str, ...], ...] = ((),)  # one onnxgen server each; (): its defaults
    engines: tuple[str, ...] | None = None  # None: onnxgen and each other engine that can run here
    gguf: str | None = None  # the llama.cpp engine's model file
    turns: int = 10
    edits: int = 3
    questions: int = 3

    def __post_init__(self) -> None:
        for name in self.workloads:
            if name not in WORKLOADS:
                raise ValueError(f"--workload {name!r} is not a workload; choose from {', '.join(WORKLOADS)}")
        for name in self.engines or ():
            if name not in ENGINES:
                raise ValueError(f"--engines {name!r} is not an engine; choose from {', '.join(ENGINES)}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1 (got {self.rounds})")
        if not self.server_flags or len(set(self.server_flags)) < len(self.server_flags):
            raise ValueError(
                f"--server-flags must name each onnxgen server once (got {list(map(list, self.server_flags))})"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1 (got {self.max_tokens})")

    def tokens_for(self, workload: str) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS[workload]


@dataclass
class WorkloadReport:
    model: str
    threads: int
    rounds: int
    server_flags: list[list[str]]
    max_tokens: dict[str, int]
    skipped: dict[str, str] = field(default_factory=dict)  # engine -> why it did not run
    server_said: dict[str, list[str]] = field(default_factory=dict)  # per server: its settings at start
    requests: list[dict[str, Any]] = field(default_factory=list)  # one per request, every round
    # engine -> workload -> group -> metric -> median over the rounds
    table: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)


def available_engines(cfg: WorkloadConfig) -> tuple[list[str], dict[str, str]]:
    """The engines to run and, for each one left out, why (an engine asked for by name must run)."""
    wanted = cfg.engines or ENGINES
    run, skipped = [], {}
    for name in wanted:
        reason = _missing(name, cfg)
        if reason is None:
            run.append(name)
        elif cfg.engines is not None:
            raise BenchError(f"--engines {name}: {reason}")
        else:
            skipped[name] = reason
    return run, skipped


def _missing(name: str, cfg: WorkloadConfig) -> str | None:
    if name == GENAI:
        if importlib.util.find_spec("onnxruntime_genai") is None:
            return "onnxruntime_genai is not installed (pip install onnxruntime-genai)"
        if not (Path(cfg.model) / "genai_config.json").is_file():
            return f"{cfg.model} has no genai_config.json"
    if name == LLAMA_CPP:
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama_cpp is not installed (pip install llama-cpp-python)"
        if cfg.gguf is None:
            return "no GGUF file given (--gguf FILE)"
        if not Path(cfg.gguf).is_file():
            return f"--gguf {cfg.gguf} is not a file"
    return None


def start_engines(name: str, cfg: WorkloadConfig) -> Iterator[Engine]:
    """The engines of kind ``name``, started one at a time: an onnxgen server per entry of
    ``server_flags``, else one."""
    from onnxgen.bench import workload_engines as we

    if name == ONNXGEN:
        for flags in cfg.server_flags:
            yield we.OnnxgenServer(cfg.model, cfg.threads, flags)
    elif name == GENAI:
        yield we.GenaiChat(cfg.model, cfg.threads)
    else:
        assert cfg.gguf is not None  # checked by available_engines
        yield we.LlamaCppChat(cfg.gguf, cfg.threads)


def run_conversation(engine: Engine, cfg: WorkloadConfig, workload: str, round_index: int) -> list[Sample]:
    convo = build(workload, round_index, turns=cfg.turns, edits=cfg.edits, questions=cfg.questions)
    history = [{"role": "system", "content": convo.system}]
    samples = []
    for i, user in enumerate(convo.user):
        messages = [*history, {"role": "user", "content": user}]
        try:
            sample = engine.chat(messages, cfg.tokens_for(workload))
        except Exception as e:  # any engine's failure, named by where it happened
            raise BenchError(
                f"{engine.name}, {workload} request {i + 1} (round {round_index + 1}): {e}"
            ) from e
        samples.append(sample)
        if convo.keep_history:
            history = [*messages, {"role": "assistant", "content": sample.text}]
    return samples


def run_workloads(cfg: WorkloadConfig) -> WorkloadReport:
    names, skipped = available_engines(cfg)
    report = WorkloadReport(
        cfg.model,
        cfg.threads,
        cfg.rounds,
        [list(flags) for flags in cfg.server_flags],
        {w: cfg.tokens_for(w) for w in cfg.workloads},
        skipped,
    )
    engines: dict[str, Engine] = {}
    try:
        for kind in names:
            for engine in start_engines(kind, cfg):
                engines[engine.name] = engine
                if isinstance(engine, OnnxgenServer):
                    report.server_said[engine.name] = engine.said()
                engine.chat([{"role": "user", "content": "Say hello."}], 4)  # warm-up, untimed
        for round_index in range(cfg.rounds):
            for name, engine in engines.items():  # engines interleaved: each round sees the same load
                for workload in cfg.workloads:
                    for i, s in enumerate(run_conversation(engine, cfg, workload, round_index)):
                        report.requests.append(_record(name, workload, round_index, i, s))
    finally:
        for engine in engines.values():
            engine.close()
    report.table = summarize(report.requests, list(engines), cfg.workloads, cfg.rounds)
    return report


def _record(engine: str, workload: str, round_index: int, index: int, s: Sample) -> dict[str, Any]:
    return {
        "engine": engine,
        "workload": workload,
        "round": round_index,
        "index": index,
        "group": "first" if index == 0 else "later",
        "prompt_tokens": s.prompt_tokens,
        "tokens": len(s.stamps_s),
        "usage_tokens": s.usage_tokens,
        "cached_tokens": s.cached_tokens,
        "stamps_s": s.stamps_s,
        "total_s": s.total_s,
        "text": s.text,
    }


def group_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """The metrics of one round's requests of one group."""
    import numpy as np

    ttft = [r["stamps_s"][0] for r in records if r["stamps_s"]]
    gaps = [b - a for r in records for a, b in zip(r["stamps_s"], r["stamps_s"][1:], strict=False)]
    decode_s = sum(r["stamps_s"][-1] - r["stamps_s"][0] for r in records if r["stamps_s"])
    tokens = sum(r["tokens"] for r in records)
    cached = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    out = {
        "requests": float(len(records)),
        "prompt_tokens": float(statistics.mean(r["prompt_tokens"] for r in records)),
        "cached_tokens": float(statistics.mean(cached)) if cached else float("nan"),
        "tokens": float(tokens),
        "decode_tok_s": len(gaps) / decode_s if decode_s > 0 else 0.0,
        "tok_s": tokens / sum(r["total_s"] for r in records),
    }
    for name, values in (("ttft", ttft), ("itl", gaps)):
        for q in (50, 90):
            out[f"{name}_p{q}_ms"] = float(np.percentile(values, q)) * 1e3 if values else 0.0
    return out


def summarize(
    records: list[dict[str, Any]], engines: list[str], workloads: tuple[str, ...], rounds: int
) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    table: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for engine in engines:
        for workload in workloads:
            for group in GROUPS:
                per_round = []
                for r in range(rounds):
                    chosen = [
                        x
                        for x in records
                        if x["engine"] == engine
                        and x["workload"] == workload
                        and x["round"] == r
                        and group in ("all", x["group"])
                    ]
                    if chosen:
                        per_round.append(group_metrics(chosen))
                if per_round:
                    table.setdefault(engine, {}).setdefault(workload, {})[group] = {
                        k: statistics.median(m[k] for m in per_round) for k in per_round[0]
                    }
    return table


def to_json(report: WorkloadReport) -> str:
    return json.dumps(asdict(report), indent=2)


def from_json(text: str) -> WorkloadReport:
    """The report :func:`to_json` wrote (``python -m onnxgen.bench.workload_run REPORT.json`` prints it)."""
    return WorkloadReport(**json.loads(text))


def format_workload_report(report: WorkloadReport) -> str:
    """The table; ``x first``: the TTFT p50 and decode tok/s of each engine over the first engine's."""
    servers = "; ".join(" ".join(flags) or "(defaults)" for flags in report.server_flags)
    width = max([6, *map(len, report.table)])
    lines = [
        f"workloads: {report.model}, {report.threads} threads, median of {report.rounds} round(s); "
        f"onnxgen serve flags: {servers}",
        f"workload  | group | {'engine':{width}} | reqs | prompt | cached | tokens | TTFT p50 | TTFT p90 | "
        "ITL p50 | ITL p90 | decode tok/s | tok/s | TTFT x first | decode x first",
    ]
    workloads = dict.fromkeys(w for e in report.table.values() for w in e)
    for workload in workloads:
        for group in GROUPS:
            rows = [(e, t[workload][group]) for e, t in report.table.items() if group in t.get(workload, {})]
            base = rows[0][1] if rows else {}
            for engine, m in rows:
                ttft_x = m["ttft_p50_ms"] / base["ttft_p50_ms"] if base["ttft_p50_ms"] else float("nan")
                decode_x = m["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else float("nan")
                lines.append(
                    f"{workload:9} | {group:5} | {engine:{width}} | {m['requests']:4.0f} | "
                    f"{m['prompt_tokens']:6.0f} | {m['cached_tokens']:6.0f} | {m['tokens']:6.0f} | "
                    f"{m['ttft_p50_ms']:8.1f} | {m['ttft_p90_ms']:8.1f} | {m['itl_p50_ms']:7.2f} | "
                    f"{m['itl_p90_ms']:7.2f} | {m['decode_tok_s']:12.1f} | {m['tok_s']:5.1f} | "
                    f"{ttft_x:12.2f} | {decode_x:14.2f}"
                )
    lines.append(
        "(times in ms; prompt, cached: mean prompt tokens and those the engine reused from earlier requests; "
        "tokens: generated in the round)"
    )
    for server, said in report.server_said.items():
        lines += [f"{server} said: {line}" for line in said]
    lines += [f"skipped {name}: {why}" for name, why in report.skipped.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    for path in sys.argv[1:]:
        print(format_workload_report(from_json(Path(path).read_text())))
