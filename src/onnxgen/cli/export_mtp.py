"""``onnxgen export-mtp CHECKPOINT_DIR EXPORT_DIR``: write a checkpoint's multi-token-prediction head as
``mtp.onnx`` beside the decoder export made from that checkpoint, so ``--speculative mtp`` can draft with it."""

from __future__ import annotations

import argparse

from onnxgen.export import PRECISIONS


def add_export_mtp(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "export-mtp",
        help=help_text,
    )
    p.add_argument(
        "checkpoint", help="the Hugging Face checkpoint directory (config.json, *.safetensors with mtp.*)"
    )
    p.add_argument("export_dir", help="the directory of the decoder export made from that checkpoint")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="the head's own projections (default: int4 when the decoder has int4 projections, else fp32)",
    )
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from onnxgen.export.mtp import check_head, export_mtp

    report = export_mtp(args.checkpoint, args.export_dir, args.precision)
    check_head(args.export_dir)
    print(report.summary())
    return 0
