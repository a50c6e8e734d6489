"""The ``onnxgen`` command line: thin wrappers over the library.

User errors (:class:`onnxgen.errors.OnnxgenError`, ``ValueError`` from parameter validation) print one
line on stderr and exit 2; they never show a traceback.

Each subcommand lives in its own module of this package (``generate``, ``chat``, ``serve``, ``bench``,
``inspect``, ``validate``, ``convert``, ``export_mtp``; ``speculative`` holds the speculative flags several share and
``bench_table`` the bench report's tables) and registers itself through an ``add_<command>(sub, help)`` hook
that sets ``run`` (and, for commands with an optional leading positional, ``take_extra_positional``).
Only the module of the command being run is imported, and the command modules import onnx and
onnxruntime (over a second of start-up) only inside ``run``: ``--help``, ``--version`` and usage errors
answer at once, and Ctrl-C while a model loads ends the command quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from onnxgen import __version__
from onnxgen.errors import OnnxgenError

Command = Callable[[argparse.Namespace], int]

# command -> (module, its add_<command> hook, one-line help for `onnxgen --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("onnxgen.cli.generate", "add_generate", "generate a completion of PROMPT"),
    "chat": ("onnxgen.cli.chat", "add_chat", "chat with a model in the terminal"),
    "bench": (
        "onnxgen.cli.bench",
        "add_bench",
        "time greedy generation (optionally beside onnxruntime-genai, per decode plan, speculative)",
    ),
    "inspect": (
        "onnxgen.cli.inspect",
        "add_inspect",
        "show a model's export family and derived I/O topology",
    ),
    "serve": ("onnxgen.cli.serve", "add_serve", "serve a model over an OpenAI-compatible HTTP API"),
    "validate": (
        "onnxgen.cli.validate",
        "add_validate",
        "compare an export's logits with a transformers checkpoint or another export",
    ),
    "convert": (
        "onnxgen.cli.convert",
        "add_convert",
        "write a GGUF file as a model directory (its quantized weights mapped exactly)",
    ),
    "export-mtp": (
        "onnxgen.cli.export_mtp",
        "add_export_mtp",
        "write a checkpoint's MTP head as mtp.onnx beside its decoder export (for --speculative mtp)",
    ),
}


def _command_in(argv: Sequence[str]) -> str | None:
    """The command named in ``argv`` (the top level has no option that takes a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, that command's flags in full and the others by name and help
    (``only=""``: every command by name and help, what ``onnxgen --help`` shows)."""
    parser = argparse.ArgumentParser(
        prog="onnxgen",
        description="Generate text from ONNX exports of language models on onnxruntime. "
        "Without MODEL, a command runs on $ONNXGEN_MODEL or the small bundled demo model.",
    )
    parser.add_argument("--version", action="version", version=f"onnxgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, hook, help_text) in COMMANDS.items():
        if only is None or name == only:
            getattr(importlib.import_module(module), hook)(sub, help_text)
        else:
            sub.add_parser(name, help=help_text)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(argv)
    try:
        parser = build_parser(command if command in COMMANDS else "")
        args = _parse(parser, argv)
        run: Command = args.run
        return run(args)
    except (OnnxgenError, ValueError, FileNotFoundError) as e:
        print(f"onnxgen {command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `onnxgen generate ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
