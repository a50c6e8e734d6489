"""``onnxgen serve [MODEL] --host 127.0.0.1 --port 8000``: an OpenAI-compatible server with batched decoding.

Also runnable as ``python -m onnxgen.cli_serve MODEL ...``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from onnxgen.cli_generate import MODEL_ENV, add_runtime_flags, load_llm
from onnxgen.errors import OnnxgenError

DEFAULT_MAX_MODEL_LEN = 2048


def add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_arguments(p)
    p.set_defaults(run=_run)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help=f"model directory (env {MODEL_ENV}; default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", help="model id clients pass (default: the model directory's name)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="prompts that may wait before 503s (default 64)")
    p.add_argument(
        "--max-model-len",
        type=int,
        help=f"tokens per sequence, prompt + generated (default: the model's context, at most {DEFAULT_MAX_MODEL_LEN})",
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=512, help="prompt tokens prefilled between decode steps"
    )
    p.add_argument(
        "--min-batch-rows",
        default="auto",
        help="pad every decode step to this many rows; auto (default): 2 where the export's int4 kernels "
        "(int8 activations) compute a lone row differently from a block on this CPU (probed at start), so "
        "a request gets the same tokens alone or beside others; else 1",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    add_runtime_flags(p)


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from onnxgen.runtime.batch import invariant_min_rows
    from onnxgen.server.app import create_app
    from onnxgen.server.scheduler import SchedulerConfig

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (got {args.port})")
    fixed_rows = None if args.min_batch_rows == "auto" else _count(args.min_batch_rows)
    llm = load_llm(args)
    context = llm.package.context_length
    max_len = args.max_model_len or min(context or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if context is not None and max_len > context:
        raise ValueError(
            f"--max-model-len {max_len} exceeds the model's context of {context} tokens; lower it"
        )
    min_rows = fixed_rows or invariant_min_rows(llm.package.graph, llm.session)  # probes this CPU
    llm.package.release_graph()  # read again for that probe only
    config = SchedulerConfig(args.max_batch, args.max_queue, max_len, args.prefill_chunk, min_rows)
    app = create_app(llm, config, args.served_model_name)
    print(
        f"onnxgen serve: {app.state.server.model_name} on http://{args.host}:{args.port} "
        f"(batch {config.max_batch}, at least {config.min_rows} row{'s' if config.min_rows != 1 else ''} a step, "
        f"{config.max_model_len} tokens per sequence)",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--min-batch-rows must be 'auto' or an integer >= 1 (got {text!r})")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onnxgen.cli_serve``: the serve command alone, with the CLI's one-line user errors."""
    parser = argparse.ArgumentParser(prog="onnxgen serve", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (OnnxgenError, ValueError, FileNotFoundError) as e:
        print(f"onnxgen serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
