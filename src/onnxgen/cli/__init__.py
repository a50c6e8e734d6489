"""The ``onnxgen`` command line: thin wrappers over the library.

User errors (:class:`onnxgen.errors.OnnxgenError`, ``ValueError`` from parameter validation) print one
line on stderr and exit 2; they never show a traceback. An unknown flag gets the command's own usage and
the closest flag it has (``did you mean --max-new-tokens?``). Short flags mean what they mean in
llama.cpp (``-t`` threads, ``-s`` seed, ``-n`` new tokens, ``-c`` the server's context).

Each subcommand lives in its own module of this package (``generate``, ``chat``, ``serve``, ``bench``,
``inspect``, ``validate``, ``pull``, ``convert``, ``export_mtp``; ``speculative`` holds the speculative flags several share and
``bench_table`` the bench report's tables) and registers itself through an ``add_<command>(sub, help)`` hook
that sets ``run`` (and, for commands with an optional leading positional, ``take_extra_positional``).
Only the module of the command being run is imported, and the command modules import onnx and
onnxruntime (over a second of start-up) only inside ``run``: ``--help``, ``--version`` and usage errors
answer at once, and Ctrl-C while a model loads ends the command quietly.
"""

from __future__ import annotations

import argparse
import difflib
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
    "pull": (
        "onnxgen.cli.pull",
        "add_pull",
        "fetch a model by name (smollm2-135m-instruct) or Hugging Face repository; later commands take the name",
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
        "MODEL is a model directory, a .onnx or .gguf file, a name from `onnxgen pull` or a Hugging Face "
        "hub id in the local cache; without it, a command runs on $ONNXGEN_MODEL or the small bundled demo "
        "model.",
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


def _command_parser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    """The parser of command ``name`` (the top-level one where there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


# llama.cpp flags with no counterpart of the same spelling on a command -> what to do instead
ELSEWHERE = {
    "-m": "the model is the first argument: onnxgen COMMAND MODEL ...",
    "--model": "the model is the first argument: onnxgen COMMAND MODEL ...",
    "-p": "the prompt is the argument after MODEL: onnxgen generate MODEL PROMPT",
    "--prompt": "the prompt is the argument after MODEL: onnxgen generate MODEL PROMPT",
    "-c": "the context size is the server's (onnxgen serve -c N); generate and chat use the model's",
    "--ctx-size": "the context size is the server's (onnxgen serve -c N); generate and chat use the model's",
    "-ngl": "onnxgen runs on onnxruntime's CPU kernels: there are no GPU layers to set",
    "--n-gpu-layers": "onnxgen runs on onnxruntime's CPU kernels: there are no GPU layers to set",
}


def suggestion(flag: str, parser: argparse.ArgumentParser) -> str:
    """`` (did you mean --max-new-tokens?)`` for a mistyped flag, else ``""``: the closest of the
    command's own option strings (argparse's ``suggest_on_error`` only exists from Python 3.14), or what
    to do instead of a llama.cpp flag this command does not have."""
    name = flag.split("=", 1)[0]
    if name in ELSEWHERE:
        return f" ({ELSEWHERE[name]})"
    options = [o for o in _options(parser) if o.startswith("--")]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, except that one positional left over after an option (``MODEL -n 5 PROMPT``) is
    handed to the command's ``take_extra_positional`` hook, and that leftovers are reported with the
    command's own usage and, for a mistyped flag, the closest flag it has."""
    named = _command_in(argv or ())
    command = _command_parser(parser, named if named in COMMANDS else None)
    names = [a.split("=", 1)[0] for a in argv or ()]
    foreign = [n for n in names if n in ELSEWHERE and n not in _options(command)]
    if command is not parser and foreign:  # before argparse reads `-ngl` as `-n gl`
        command.error(f"unrecognized arguments: {foreign[0]}{suggestion(foreign[0], command)}")
    args, extras = parser.parse_known_args(argv)
    take = getattr(args, "take_extra_positional", None)
    if len(extras) == 1 and not extras[0].startswith("-") and take is not None and take(args, extras[0]):
        return args
    if extras:
        flags = [e for e in extras if e.startswith("-") and len(e) > 1 and not _is_number(e)]
        hint = suggestion(flags[0], command) if flags else ""
        command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return args


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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
