"""The ``onnxgen`` command line: thin wrappers over the library.

User errors (:class:`onnxgen.errors.OnnxgenError`, ``ValueError`` from parameter validation) print one
line on stderr and exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from onnxgen.errors import OnnxgenError

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxgen", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from onnxgen.cli_inspect import add_inspect

    add_inspect(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Command = args.run
    try:
        return run(args)
    except (OnnxgenError, ValueError, FileNotFoundError) as e:
        print(f"onnxgen {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
