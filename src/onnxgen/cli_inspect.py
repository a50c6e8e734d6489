"""``onnxgen inspect [MODEL] [--json]``: a model's export family, derived I/O topology and decode plan."""

from __future__ import annotations

import argparse
import json

from onnxgen.cli_generate import MODEL_ENV, resolve_model
from onnxgen.graph.decode_fusions import planned_fusions
from onnxgen.graph.hybrid_ops import apply_fast_ops
from onnxgen.model.inspect import describe, format_text
from onnxgen.model.mtp import find_mtp_head, mtp_head_io
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.plans import choose_decode_plan, summarize_scans


def add_inspect(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a model's export family and derived I/O topology")
    p.add_argument(
        "model",
        nargs="?",
        help=f"model directory or model.onnx path (default: ${MODEL_ENV}, then the bundled model)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)


def decode_plan_summary(package: ModelPackage) -> dict[str, str]:
    """The plan ``load(model)`` (``decode_plan="auto"``) chooses for single-token steps, and why; from the
    graph alone (no weights loaded, no session made)."""
    choice = choose_decode_plan("auto", summarize_scans(package.graph))
    reason = choice.reason
    if choice.plan == "inline":  # what the runtime checks before it uses the sibling
        reason += "; used where its first step equals the Scan plan's bit for bit, else the Scan plan"
    return {"decode_plan": choice.plan, "decode_plan_reason": reason}


def fast_ops_summary(package: ModelPackage) -> dict[str, str]:
    """What ``load(model)`` on the CPU does with a hybrid's fused ops (:mod:`onnxgen.graph.hybrid_ops`);
    nothing for a model without recurrent state."""
    if not package.io.state_pairs:
        return {}
    return {"fast_ops": apply_fast_ops(package.graph, None)[1].summary()}


def fusions_summary(package: ModelPackage) -> dict[str, str]:
    """What ``load(model)`` on the CPU merges for decode steps (:mod:`onnxgen.graph.decode_fusions`)."""
    return {"decode_fusions": planned_fusions(package.graph).summary()}


def mtp_summary(package: ModelPackage) -> dict[str, str]:
    """The MTP head beside the model (``--speculative mtp`` drafts with it), and its hidden-state ports."""
    path = find_mtp_head(package)
    if path is None:
        return {}
    head = mtp_head_io(package, path)
    return {"mtp_head": f"{path.name} (reads {head.hidden_input!r}, drafts on {head.hidden_output!r})"}


def _run(args: argparse.Namespace) -> int:
    package = ModelPackage.open(resolve_model(args.model))
    summary = describe(package)
    summary.update(decode_plan_summary(package))
    summary.update(fast_ops_summary(package))
    summary.update(fusions_summary(package))
    summary.update(mtp_summary(package))
    print(json.dumps(summary, indent=2) if args.json else format_text(summary))
    return 0
