"""``onnxgen bench [MODEL]``: prefill, TTFT, decode tok/s and memory, optionally beside onnxruntime-genai,
per decode plan (``--decode-plan scan,inline``) and with speculative decoding beside plain decoding.

The harness is :mod:`onnxgen.bench`; this module parses flags and prints the tables
(:mod:`onnxgen.cli.bench_table`) or ``--json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from onnxgen.bench.constraints import CONSTRAINTS
from onnxgen.bench.genai_engine import GENAI
from onnxgen.bench.prompts import PROMPT_KINDS
from onnxgen.bench.workload_engines import ENGINES
from onnxgen.bench.workloads import WORKLOADS
from onnxgen.cli.generate import (
    MODEL_ENV,
    MODEL_HELP,
    THREADS_ENV,
    add_fast_ops_flag,
    resolve_model,
    resolve_threads,
)
from onnxgen.cli.speculative import add_speculative_flags
from onnxgen.runtime.plan_names import DECODE_PLANS

__all__ = ["add_bench"]

DEFAULT_PROMPT_TOKENS = (16, 512)


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


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(part.strip() for part in text.split(",") if part.strip())


def _add_prompt_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts (each gets its own workers and rows)")
    g.add_argument(
        "--prompt-tokens",
        type=_int_list,
        metavar="N[,N...]",
        help=f"prompt lengths of the built-in kinds (default {','.join(map(str, DEFAULT_PROMPT_TOKENS))})",
    )
    g.add_argument(
        "--prompt-kind",
        metavar="KIND[,KIND...]",
        help=f"built-in prompts: {', '.join(PROMPT_KINDS)} (default: synthetic; repetitive,novel with "
        "--speculative; none when --prompt-file is given)",
    )
    g.add_argument(
        "--prompt-file",
        action="append",
        metavar="FILE",
        help="a prompt text encoded with the model's tokenizer and used whole (repeatable)",
    )


def add_bench(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "bench",
        help=help_text,
        description="Greedy generation of exactly --new-tokens tokens from each prompt, each worker "
        "(engine or decode plan) in its own process with the same thread count, runs interleaved.",
    )
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP} (default: ${MODEL_ENV}, then the bundled model)")
    _add_prompt_flags(p)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    p.add_argument("--warmups", type=int, default=1, help="untimed runs per worker first (default 1)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per worker (default 5)")
    p.add_argument(
        "--decode-skip", type=int, default=0, metavar="N", help="leave the first N decode steps out"
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="start each worker N times in turn and pool their runs (default 1): a process's memory "
        "placement moves its speed by a few percent, which one worker per engine cannot average out",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        help=f"intra-op threads for every engine (env {THREADS_ENV}; default: all cores)",
    )
    p.add_argument("--compare", choices=[GENAI], help="also run this engine")
    p.add_argument(
        "--decode-plan",
        metavar="PLAN[,PLAN...]",
        help=f"one onnxgen worker per plan ({', '.join(DECODE_PLANS)}), side by side "
        "(default: one worker on auto)",
    )
    add_fast_ops_flag(p)
    add_speculative_flags(p)
    p.add_argument(
        "--constraint",
        metavar="KIND[,KIND...]",
        help=f"also time constrained greedy decoding with built-in constraints ({', '.join(CONSTRAINTS)}), "
        "alternating with plain runs in each onnxgen worker",
    )
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        help="instead: a 10-turn chat and 8 server clients sharing a system prompt, with the prefix cache "
        "and without (onnxgen.bench.prefix)",
    )
    p.add_argument(
        "--prefix-cache-mb", type=float, default=512, help="the cache's budget there (default 512)"
    )
    p.add_argument("--no-server", action="store_true", help="--prefix-cache: the chat part only")
    p.add_argument(
        "--reply-tokens",
        type=int,
        default=32,
        help="--prefix-cache: tokens of each chat reply (default 32; 200 makes replies as long as the "
        "~200-token user turns)",
    )
    _add_workload_flags(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run)


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "workloads (instead: what a user sends, against `onnxgen serve` with its defaults, beside "
        "onnxruntime-genai and llama.cpp)"
    )
    g.add_argument(
        "--workload",
        metavar="NAME[,NAME...]",
        help=f"{', '.join(WORKLOADS)} or all: a 10-turn chat, rename-a-variable edits of a ~140-line file, "
        "questions over ~1.4k tokens of documentation",
    )
    g.add_argument("--rounds", type=int, default=3, help="times each workload runs (default 3; the median)")
    g.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="tokens per reply at most (default: chat 96, code-edit 256, rag 128)",
    )
    g.add_argument(
        "--server-flags",
        action="append",
        metavar='"FLAGS"',
        help='flags for onnxgen serve, e.g. "--speculative off --prefix-cache-mb 0"; repeat it to run one '
        'server per value side by side ("" for one with the defaults; default: one with the defaults)',
    )
    g.add_argument(
        "--engines",
        metavar="NAME[,NAME...]",
        help=f"{', '.join(ENGINES)} (default: onnxgen and each other one installed and given a model)",
    )
    g.add_argument(
        "--gguf", metavar="FILE", help="the model as a GGUF file, for llama.cpp (llama-cpp-python)"
    )
    g.add_argument("--chat-turns", type=int, default=10, help="user turns of the chat (default 10)")
    g.add_argument("--edits", type=int, default=3, help="edits of the code-edit workload (default 3)")
    g.add_argument("--questions", type=int, default=3, help="questions of the rag workload (default 3)")


def _run(args: argparse.Namespace) -> int:
    from onnxgen.bench.harness import BenchConfig, prompt_cases, run_bench, to_json
    from onnxgen.cli.bench_table import format_report
    from onnxgen.runtime.session import default_threads

    threads = resolve_threads(args.threads) or default_threads()
    if args.workload:
        return _run_workloads(args, threads)
    if args.prefix_cache:
        from onnxgen.bench.prefix import PrefixBenchConfig, format_prefix_report, run_prefix_bench

        model = str(resolve_model(args.model))
        prefix_cfg = PrefixBenchConfig(
            model,
            threads,
            args.prefix_cache_mb,
            server=not args.no_server,
            runs=args.runs,
            new_tokens=args.reply_tokens,
        )
        prefix_report = run_prefix_bench(prefix_cfg)
        print(
            json.dumps(prefix_report.__dict__, indent=2) if args.json else format_prefix_report(prefix_report)
        )
        return 0
    cfg = BenchConfig(
        model=args.model or "",  # resolved below, once the settings are known to be good
        prompt_tokens=args.prompt_tokens or DEFAULT_PROMPT_TOKENS,
        new_tokens=args.new_tokens,
        warmups=args.warmups,
        runs=args.runs,
        decode_skip=args.decode_skip,
        threads=threads,
        compare=args.compare,
        decode_plans=_names(args.decode_plan) or (),
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
        prompt_kinds=_names(args.prompt_kind),
        prompt_files=tuple(args.prompt_file or ()),
        constraints=_names(args.constraint) or (),
        processes=args.processes,
        fast_ops=args.fast_ops,
    )
    prompt_cases(cfg)  # a prompt file that cannot be read: an error before the model is looked for
    report = run_bench(replace(cfg, model=str(resolve_model(args.model))))
    print(to_json(report) if args.json else format_report(report))
    return 0


def _run_workloads(args: argparse.Namespace, threads: int) -> int:
    import shlex

    from onnxgen.bench.workload_run import WorkloadConfig, format_workload_report, run_workloads, to_json

    names = _names(args.workload) or ()
    cfg = WorkloadConfig(
        model=args.model or "",  # resolved below, once the settings are known to be good
        threads=threads,
        workloads=WORKLOADS if names == ("all",) else names,
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        server_flags=tuple(tuple(shlex.split(flags)) for flags in args.server_flags or [""]),
        engines=_names(args.engines),
        gguf=args.gguf,
        turns=args.chat_turns,
        edits=args.edits,
        questions=args.questions,
    )
    report = run_workloads(replace(cfg, model=str(resolve_model(args.model))))
    print(to_json(report) if args.json else format_workload_report(report))
    return 0
