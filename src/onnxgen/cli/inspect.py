"""``onnxgen inspect [MODEL] [--json] [--memory]``: a model's export family, derived I/O topology, graph
passes and decode plan, from the model prepared as a load prepares it (:func:`onnxgen.prepare.prepare`; an
onnxruntime session is made only where the inline plan's check must run to settle the plan); with
``--memory`` it loads the model and one request and says where the memory went."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnxgen.cli.generate import MODEL_ENV, MODEL_HELP, resolve_model

if TYPE_CHECKING:
    from onnxgen.model.package import ModelPackage
    from onnxgen.prepare import PreparedModel


def add_inspect(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("inspect", help=help_text)
    p.add_argument(
        "model",
        nargs="?",
        help=f"{MODEL_HELP} (default: ${MODEL_ENV}, then the bundled model)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    g = p.add_argument_group("memory (--memory loads the model and runs one greedy request)")
    g.add_argument("--memory", action="store_true", help="show where a loaded model's memory is")
    g.add_argument(
        "-t",
        "--threads",
        type=int,
        help="intra-op threads of a load (--memory, the inline plan's check; default: all cores)",
    )
    g.add_argument("--prompt-tokens", type=int, default=16, help="prompt of the request (default 16)")
    g.add_argument("--new-tokens", type=int, default=16, help="tokens it generates (default 16)")
    p.set_defaults(run=_run)


def decode_plan_summary(prepared: PreparedModel) -> dict[str, str]:
    """The plan ``load(model)`` runs single-token steps on, and why. Decided by :func:`onnxgen.prepare.prepare`
    where the graph settles it; where the inline plan is chosen, a session is made on the prepared graph and
    the inline plan's first-step check run as the first decode step would (:meth:`DecodePlan.settle`), so the
    plan named is the one the runtime uses, the Scan plan where the check fails."""
    choice = prepared.decode.choice
    if choice.plan != "inline":
        return {
            "decode_plan": choice.plan,
            "decode_plan_reason": choice.reason,
            "decode_plan_check": "not needed",
        }
    prepared.open_session()  # the plan's check runs on the session it is attached to
    plan = prepared.decode.plan
    settled = plan.settle()
    check = plan.check
    verdict = "not run" if check is None else "passed" if check.equal else "failed"
    return {"decode_plan": settled.plan, "decode_plan_reason": settled.reason, "decode_plan_check": verdict}


def fast_ops_summary(prepared: PreparedModel) -> dict[str, str]:
    """What ``load(model)`` does with a hybrid's fused ops (:mod:`onnxgen.graph.hybrid_ops`); nothing for a
    model without recurrent state."""
    if not prepared.package.io.state_pairs:
        return {}
    return {"fast_ops": prepared.graph.fast_ops.summary()}


def fusions_summary(prepared: PreparedModel) -> dict[str, str]:
    """What ``load(model)`` merges for decode steps (:mod:`onnxgen.graph.decode_fusions`)."""
    return {"decode_fusions": prepared.graph.fusions.summary()}


MB = float(1 << 20)


def memory_report(model: Path, threads: int | None, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    """Load ``model`` in this process, run one greedy request, and split the resident memory by what holds
    it (MiB; :mod:`onnxgen.runtime.memory` reads ``/proc/self/smaps``).

    Measured: resident pages of the weight files the session maps, of shared libraries, and of anonymous
    memory (heap) at three moments. onnxruntime does not tell Python the size of its packed weights or of
    its arena, so those are deltas of anonymous memory: the load's (packed weights, initializers it copies,
    the graph, the tokenizer) and the request's (KV and state pages written, activations in the arena).
    The KV and state buffers' size is computed from their shapes (pages never written are not resident).
    """
    from onnxgen import SamplingParams, load
    from onnxgen.runtime import hugepages, memory

    if prompt_tokens < 1 or new_tokens < 1:
        raise ValueError(f"--prompt-tokens and --new-tokens must be >= 1 (got {prompt_tokens}, {new_tokens})")
    base = memory.breakdown([])
    start = time.perf_counter()
    llm = load(model, threads=threads)
    load_s = time.perf_counter() - start
    hugepages.wait()
    folders = llm.session.weight_folders
    loaded, peak_load = memory.breakdown(folders), memory.peak_rss_bytes()
    vocab = max(llm.session.vocab_size, 2)
    prompt = [1 + (7919 * i + 13) % (vocab - 1) for i in range(prompt_tokens)]
    params = SamplingParams(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0, detokenize=False
    )
    llm.generate(prompt, params)
    ran = memory.breakdown(folders)
    buffers = llm.session.new_state(prompt_tokens + new_tokens).nbytes
    request = ran.anonymous - loaded.anonymous
    return {
        "model": str(model),
        "load_s": load_s,
        "prepared_graph": llm.session.prepared.cache,
        "decode_fusions": llm.session.fusions.summary(),
        "weights_mapped_mb": ran.weights_mapped / MB,
        "weights_resident_mb": ran.weights_resident / MB,
        "weight_files": {
            path: {"mapped_mb": m / MB, "resident_mb": r / MB} for path, (m, r) in ran.weights.items()
        },
        "load_heap_mb": (loaded.anonymous - base.anonymous) / MB,
        "kv_state_buffers_mb": buffers / MB,
        "request_heap_mb": request / MB,
        "python_before_load_mb": base.total / MB,
        "libraries_mb": ran.libraries / MB,
        "libraries_added_by_load_mb": (loaded.libraries - base.libraries) / MB,
        "other_files_mb": ran.other_files / MB,
        "rss_after_load_mb": loaded.total / MB,
        "peak_during_load_mb": peak_load / MB,
        "rss_after_request_mb": ran.total / MB,
        "peak_rss_mb": memory.peak_rss_bytes() / MB,
        "request": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens},
    }


def format_memory(r: dict[str, Any]) -> str:
    rows = [
        (
            "weights mapped from files",
            f"{r['weights_resident_mb']:.0f} resident of {r['weights_mapped_mb']:.0f} mapped",
        ),
        (
            "heap added by the load",
            f"{r['load_heap_mb']:.0f}  (onnxruntime's packed weights, copied initializers, graph; tokenizer)",
        ),
        (
            "heap added by the request",
            f"{r['request_heap_mb']:.0f}  (KV/state pages written, onnxruntime's arena)",
        ),
        (
            "KV/state buffers of the request",
            f"{r['kv_state_buffers_mb']:.1f}  (allocated; pages never written are not resident)",
        ),
        ("Python and imports before load", f"{r['python_before_load_mb']:.0f}"),
        (
            "shared libraries",
            f"{r['libraries_mb']:.0f}  ({r['libraries_added_by_load_mb']:.0f} of them touched by the load)",
        ),
        ("other mapped files", f"{r['other_files_mb']:.0f}"),
        ("RSS after load / after request", f"{r['rss_after_load_mb']:.0f} / {r['rss_after_request_mb']:.0f}"),
        ("peak RSS during load / overall", f"{r['peak_during_load_mb']:.0f} / {r['peak_rss_mb']:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    req = r["request"]
    head = [
        f"model: {r['model']}",
        f"load: {r['load_s']:.2f} s (prepared graph: {r['prepared_graph']}; fusions: {r['decode_fusions']})",
        f"request: {req['prompt_tokens']} prompt tokens, {req['new_tokens']} new (greedy); MiB:",
    ]
    return "\n".join(head + [f"  {k.ljust(width)}  {v}" for k, v in rows])


def mtp_summary(package: ModelPackage) -> dict[str, str]:
    """The MTP head beside the model (``--speculative mtp`` drafts with it), and its hidden-state ports."""
    from onnxgen.model.mtp import find_mtp_head, mtp_head_io

    path = find_mtp_head(package)
    if path is None:
        return {}
    head = mtp_head_io(package, path)
    return {"mtp_head": f"{path.name} (reads {head.hidden_input!r}, drafts on {head.hidden_output!r})"}


def prefix_cache_summary(package: ModelPackage) -> dict[str, str]:
    """What the prefix cache (``--prefix-cache-mb``) spends per cached token and per state checkpoint."""
    from onnxgen.cache.prefix import cache_costs

    costs = cache_costs(package.io)
    out = {"prefix_cache_kv_per_token": f"{costs.kv_bytes_per_token:,} bytes (+8 for the token id)"}
    if package.io.state_pairs:
        out["prefix_cache_state_checkpoint"] = (
            f"{costs.state_bytes_per_checkpoint:,} bytes ({costs.state_bytes_per_checkpoint / (1 << 20):.2f} MiB)"
        )
    return out


def _run(args: argparse.Namespace) -> int:
    if args.memory:
        report = memory_report(resolve_model(args.model), args.threads, args.prompt_tokens, args.new_tokens)
        print(json.dumps(report, indent=2) if args.json else format_memory(report))
        return 0
    from onnxgen.config import EngineConfig
    from onnxgen.model.inspect import describe, format_text
    from onnxgen.model.package import ModelPackage
    from onnxgen.prepare import prepare

    model = resolve_model(args.model)
    package = ModelPackage.open(model)
    summary = describe(package)
    prepared = prepare(package, EngineConfig.from_env(threads=args.threads))
    summary.update(fast_ops_summary(prepared))
    summary.update(fusions_summary(prepared))
    summary.update(mtp_summary(package))
    summary.update(prefix_cache_summary(package))
    summary.update(decode_plan_summary(prepared))
    print(json.dumps(summary, indent=2) if args.json else format_text(summary))
    return 0
