"""The ``onnxgen`` command line: thin wrappers over the library.

User errors (:class:`onnxgen.errors.OnnxgenError`, ``ValueError`` from parameter validation) print one
line on stderr and exit 2; they never show a traceback.

Each subcommand lives in its own module and registers itself through an ``add_<command>(sub)`` hook
that sets ``run`` (and, for commands with an optional leading positional, ``take_extra_positional``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from onnxgen.errors import OnnxgenError

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnxgen",
        description="Generate text from ONNX exports of language models on onnxruntime. "
        "Without MODEL, a command runs on $ONNXGEN_MODEL or the small bundled demo model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from onnxgen.cli_bench import add_bench
    from onnxgen.cli_chat import add_chat
    from onnxgen.cli_export_mtp import add_export_mtp
    from onnxgen.cli_generate import add_generate
    from onnxgen.cli_inspect import add_inspect
    from onnxgen.cli_serve import add_serve
    from onnxgen.cli_validate import add_validate

    add_generate(sub)
    add_chat(sub)
    add_bench(sub)
    add_inspect(sub)
    add_serve(sub)
    add_validate(sub)
    add_export_mtp(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, except that one positional left over after an option (``MODEL -n 5 PROMPT``) is
    handed to the command's ``take_extra_positional`` hook."""
    args, extras = parser.parse_known_args(argv)
    take = getattr(args, "take_extra_positional", None)
    if len(extras) == 1 and not extras[0].startswith("-") and take is not None and take(args, extras[0]):
        return args
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    run: Command = args.run
    try:
        return run(args)
    except (OnnxgenError, ValueError, FileNotFoundError) as e:
        print(f"onnxgen {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `onnxgen generate ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
