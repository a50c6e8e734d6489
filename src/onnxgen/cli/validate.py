"""``onnxgen validate [EXPORT] (--reference HF_DIR_OR_EXPORT | --self)``: is the export right?

Teacher-forced logits of the export against a reference at every position of a few prompts
(:mod:`onnxgen.validate`). Exit status 0 when every threshold holds, 1 when one is passed (the lines
saying which, and where the first top-1 miss is), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json

from onnxgen.cli.generate import MODEL_ENV, add_runtime_flags, resolve_model, resolve_threads
from onnxgen.validate import (
    DEFAULT_NEW_TOKENS,
    PROMPTS,
    QUANTIZED,
    Thresholds,
    format_report,
    read_prompts,
    validate,
)


def add_validate(sub: argparse._SubParsersAction, help_text: str) -> None:
    exact = Thresholds()
    p = sub.add_parser(
        "validate",
        help=help_text,
        description="Teacher-forced over a few prompts, compare the export's logits (as onnxgen runs it) "
        "with the reference's at every position: top-1 agreement, max |Δlogit|, mean KL, and where the "
        "greedy continuations part. Exit 1 past a threshold.",
    )
    p.add_argument(
        "export",
        nargs="?",
        help=f"the export directory to check (default: ${MODEL_ENV}, then the bundled model)",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--reference",
        metavar="HF_DIR_OR_EXPORT",
        help="a transformers checkpoint (pip install 'onnxgen[validate]') or another export (run with its "
        "ops as exported, e.g. the fp32 export for an int4 one)",
    )
    which.add_argument(
        "--self",
        dest="self_check",
        action="store_true",
        help="onnxgen's own rewrites (fast ops, fusions, decode plan, logits-to-keep) against the export's "
        "ops as they are",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help=f"one prompt per line (\\n for a line break; a line of integers is token ids); default: "
        f"{len(PROMPTS)} built-in code and prose prompts",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=DEFAULT_NEW_TOKENS,
        help=f"reference-greedy tokens after each prompt (default {DEFAULT_NEW_TOKENS})",
    )
    g = p.add_argument_group(
        "thresholds (defaults: exact where the export holds the reference's weights, quantized where "
        f"only the export is int4/int8: top-1 >= {exact.min_top1} / {QUANTIZED.min_top1}, mean KL <= "
        f"{exact.max_kl} / {QUANTIZED.max_kl})"
    )
    g.add_argument("--min-top1", type=float, help="least top-1 agreement over all positions")
    g.add_argument("--max-kl", type=float, help="largest mean KL(reference || export)")
    g.add_argument("--max-abs", type=float, help="largest |Δlogit| (default: not checked)")
    g.add_argument(
        "--min-greedy",
        type=int,
        metavar="N",
        help="fail where greedy continuations part within the first N tokens (default: not checked)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_runtime_flags(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    given = {
        "min_top1": args.min_top1,
        "max_kl": args.max_kl,
        "max_abs": args.max_abs,
        "min_greedy": args.min_greedy,
    }
    thresholds = {name: value for name, value in given.items() if value is not None}
    report = validate(
        resolve_model(args.export),
        args.reference,
        self_check=args.self_check,
        prompts=read_prompts(args.prompts) if args.prompts else PROMPTS,
        new_tokens=args.new_tokens,
        thresholds=thresholds,
        threads=resolve_threads(args.threads),
        decode_plan=args.decode_plan,
        fast_ops=args.fast_ops,
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 1 if report.failures() else 0
