"""``onnxgen inspect MODEL [--json]`` (filled in by the model/I/O work)."""

from __future__ import annotations

import argparse


def add_inspect(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a model's export family and derived I/O topology")
    p.add_argument("model", help="model directory (or model.onnx path)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    raise NotImplementedError("inspect is not built yet")
