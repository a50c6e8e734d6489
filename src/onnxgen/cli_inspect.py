"""``onnxgen inspect MODEL [--json]``: a model's export family and derived I/O topology."""

from __future__ import annotations

import argparse
import json

from onnxgen.model.inspect import describe, format_text
from onnxgen.model.package import ModelPackage


def add_inspect(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a model's export family and derived I/O topology")
    p.add_argument("model", help="model directory (or model.onnx path)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    summary = describe(ModelPackage.open(args.model))
    print(json.dumps(summary, indent=2) if args.json else format_text(summary))
    return 0
