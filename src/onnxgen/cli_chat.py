"""``onnxgen chat [MODEL]``: a REPL that keeps the conversation and streams each answer.

Lines typed are user turns; ``/reset`` clears the history (the system message stays), ``/exit``
(or end of input) leaves. A turn that fails (e.g. the history no longer fits the context) prints one
error line and is dropped; the REPL goes on.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from onnxgen.cli_generate import (
    MODEL_ENV,
    add_prefix_cache_flags,
    add_runtime_flags,
    add_sampling_flags,
    format_stats,
    load_llm,
    sampling_params,
    write_stream,
)
from onnxgen.cli_speculative import add_speculative_flags, speculative_from_args
from onnxgen.errors import OnnxgenError
from onnxgen.generation.generator import GenerationResult
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import Speculative
from onnxgen.llm import LLM

COMMANDS = {
    "/reset": "forget the conversation (keeps the system message)",
    "/exit": "leave (end of input, Ctrl-D, does too)",
    "/help": "show these commands",
}
PROMPT_MARK = ">>> "
# a chat resumes each turn from the previous one's cached state (its history is never prefilled again)
CHAT_PREFIX_CACHE_MB = 512


class ChatSession:
    """A conversation: the messages so far, and one method to add a streamed turn."""

    def __init__(
        self,
        llm: LLM,
        params: SamplingParams,
        system: str | None = None,
        speculative: Speculative | None = None,
    ) -> None:
        self.llm = llm
        self.params = params
        self.system = system
        self.speculative = speculative
        self.messages: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def ask(self, text: str, out: TextIO) -> GenerationResult:
        """Stream the answer to ``text`` into ``out``; keep the turn only when it completes."""
        turn = [*self.messages, {"role": "user", "content": text}]
        result = write_stream(self.llm.stream_chat(turn, self.params, self.speculative), out)
        self.messages = [*turn, {"role": "assistant", "content": result.text}]
        return result


def add_chat(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Chat with a model: each line is a user turn; "
        + "; ".join(f"{k}: {v}" for k, v in COMMANDS.items()),
    )
    p.add_argument(
        "model", nargs="?", help=f"model directory (default: ${MODEL_ENV}, then the bundled model)"
    )
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument(
        "--stats",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="print a stats line after each answer",
    )
    add_runtime_flags(p)
    add_prefix_cache_flags(p, CHAT_PREFIX_CACHE_MB)
    add_sampling_flags(p)
    add_speculative_flags(p)
    p.set_defaults(run=_run)


def _read_line(interactive: bool) -> str | None:
    """The next line of input without its newline, or None at end of input."""
    if interactive:
        try:
            return input(PROMPT_MARK)
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def repl(session: ChatSession, *, show_stats: bool = False) -> int:
    interactive = sys.stdin.isatty()
    while (line := _read_line(interactive)) is not None:
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            session.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if text.startswith("/"):
            print("\n".join(f"{k:8} {v}" for k, v in COMMANDS.items()), file=sys.stderr)
            continue
        try:
            result = session.ask(text, sys.stdout)
        except OnnxgenError as e:
            print(f"\nonnxgen chat: error: {e} (/reset clears the history)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if show_stats:
            print(format_stats(result), file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    spec = speculative_from_args(args)
    session = ChatSession(
        load_llm(args, speculative=spec is not None), params, system=args.system, speculative=spec
    )
    return repl(session, show_stats=args.stats)
