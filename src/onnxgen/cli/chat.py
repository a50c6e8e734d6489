"""``onnxgen chat [MODEL]``: a REPL that keeps the conversation and streams each answer.

Lines typed are user turns; ``/reset`` (ollama's ``/clear``) clears the history (the system message
stays), ``/set NAME VALUE`` (ollama's ``/set parameter NAME VALUE`` too) changes a sampling setting or the
system message for the turns that follow, ``/exit`` (``/bye``, or end of input) leaves; any other line
whose first word is ``/word`` is named as an unknown command and never sent to the model. A line that starts with ``\"\"\"``
opens a multi-line message closed by a line that ends with ``\"\"\"``; a line that ends with ``\\``
continues on the next. Ctrl-C while an answer is written stops that answer and drops the turn; the
conversation goes on. An answer runs to end-of-sequence (bounded by the context) unless ``-n`` says
less, and one cut off by either is marked. In a terminal, lines are edited with readline and kept in a
history file across sessions (``$ONNXGEN_CHAT_HISTORY``, default ``~/.local/state/onnxgen/chat_history``). A turn that fails (e.g. the history no longer fits the context) prints one
error line and is dropped; the REPL goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from onnxgen.cli.generate import (
    MODEL_ENV,
    MODEL_HELP,
    SAMPLING_DEFAULTS,
    add_chat_template_flag,
    add_prefix_cache_flags,
    add_runtime_flags,
    add_sampling_flags,
    check_chat_template,
    format_stats,
    load_llm,
    model_label,
    sampling_params,
    terminal_log,
    write_stream,
)
from onnxgen.cli.speculative import add_speculative_flags, speculative_from_args
from onnxgen.errors import OnnxgenError
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import Speculative

if TYPE_CHECKING:
    from onnxgen.generation.generator import GenerationResult
    from onnxgen.llm import LLM

COMMANDS = {
    "/reset": "forget the conversation (keeps the system message; also /clear)",
    "/set": "NAME VALUE changes a setting for the next turns (temperature, top_k, top_p, min_p, seed, "
    "num_predict, repeat_penalty, presence_penalty, frequency_penalty, system)",
    "/exit": "leave (also /bye, /quit, or end of input: Ctrl-D)",
    "/help": "show these commands",
}
EXIT_COMMANDS = ("/exit", "/quit", "/bye")
RESET_COMMANDS = ("/reset", "/clear")
# /set names (ollama's and llama.cpp's spellings beside the library's) -> SamplingParams field, value type
SET_NAMES: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "temp": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "seed": ("seed", int),
    "num_predict": ("max_new_tokens", int),
    "n_predict": ("max_new_tokens", int),
    "max_new_tokens": ("max_new_tokens", int),
    "max_tokens": ("max_new_tokens", int),
    "repeat_penalty": ("repetition_penalty", float),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}
_COMMAND = re.compile(r"/[A-Za-z?]+(?=\s|$)")  # `/set ...` is a command; `/usr/bin is ...` is text
PROMPT_MARK = ">>> "
# a chat resumes each turn from the previous one's cached state (its history is never prefilled again)
CHAT_PREFIX_CACHE_MB = None  # the engine's automatic budget
CONTINUATION_MARK = "... "
FENCE = '"""'
HISTORY_ENV = "ONNXGEN_CHAT_HISTORY"
HISTORY_LINES = 1000
NO_CONTEXT_LIMIT = 4096  # answer length for a model that states no context length


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

    def set(self, name: str, text: str) -> str:
        """``/set NAME VALUE``: change a sampling setting (or the system message, ``system``) for the turns
        that follow; returns what changed. Raises ValueError naming the setting and the accepted names."""
        if name == "system":
            self.system = text or None
            rest = [m for m in self.messages if m["role"] != "system"]
            self.messages = [{"role": "system", "content": text}, *rest] if text else rest
            return f"system message set to {text!r}" if text else "system message removed"
        if name not in SET_NAMES:
            raise ValueError(f"/set knows {', '.join([*SET_NAMES, 'system'])}; got {name!r}")
        field, kind = SET_NAMES[name]
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(
                f"/set {name} takes {'an integer' if kind is int else 'a number'} (got {text!r})"
            ) from None
        changes: dict[str, Any] = {field: value}
        if field == "temperature" and value == 0:  # greedy, as --temp 0: the default filters go too
            base = SamplingParams()
            changes |= {
                k: getattr(base, k) for k, v in SAMPLING_DEFAULTS.items() if getattr(self.params, k) == v
            }
        self.params = dataclasses.replace(self.params, **changes)
        return f"{field} = {value}"

    def ask(self, text: str, out: TextIO) -> GenerationResult:
        """Stream the answer to ``text`` into ``out``; keep the turn only when it completes (an error or
        a KeyboardInterrupt while it streams leaves the conversation as it was)."""
        turn = [*self.messages, {"role": "user", "content": text}]
        result = write_stream(self.llm.stream_chat(turn, self.params, self.speculative), out)
        self.messages = [*turn, {"role": "assistant", "content": result.text}]
        return result


def add_chat(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "chat",
        help=help_text,
        description="Chat with a model: each line is a user turn; "
        + "; ".join(f"{k}: {v}" for k, v in COMMANDS.items())
        + f". {FENCE} opens and closes a multi-line message. Ctrl-C stops the answer being written.",
    )
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP} (default: ${MODEL_ENV}, then the bundled model)")
    p.add_argument("--system", metavar="TEXT", help="system message")
    add_chat_template_flag(p)
    p.add_argument(
        "--stats",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="print a stats line after each answer",
    )
    add_runtime_flags(p)
    add_prefix_cache_flags(p, CHAT_PREFIX_CACHE_MB)
    add_sampling_flags(p, max_new_tokens="to end-of-sequence, bounded by the context")
    add_speculative_flags(p)
    p.set_defaults(run=_run)


class _Input:
    """Lines from the terminal (readline editing and history) or from a pipe."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.history: Path | None = None
        if interactive:
            self._start_history()

    def _start_history(self) -> None:
        try:
            import readline
        except ImportError:  # pragma: no cover - Python without readline: plain input()
            return
        state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        self.history = Path(os.environ.get(HISTORY_ENV) or state / "onnxgen" / "chat_history")
        with contextlib.suppress(OSError):  # no history yet, or unreadable: start empty
            readline.read_history_file(self.history)
        readline.set_history_length(HISTORY_LINES)

    def save_history(self) -> None:
        if self.history is None:
            return
        import readline

        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(self.history)
        except OSError as e:
            print(f"onnxgen chat: history not saved to {self.history} ({e})", file=sys.stderr)

    def line(self, mark: str) -> str | None:
        """The next line without its newline, or None at end of input."""
        if self.interactive:
            try:
                return input(mark)
            except EOFError:
                print()
                return None
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None

    def message(self) -> str | None:
        """The next message: one line, a ``\"\"\"`` block or ``\\``-continued lines; None at end of input."""
        first = self.line(PROMPT_MARK)
        if first is None:
            return None
        if first.lstrip().startswith(FENCE):
            return self._block(first.lstrip()[len(FENCE) :])
        lines = [first]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            more = self.line(CONTINUATION_MARK)
            if more is None:
                break
            lines.append(more)
        return "\n".join(lines)

    def _block(self, rest: str) -> str:
        lines: list[str] = []
        line: str | None = rest
        while line is not None:
            if line.rstrip().endswith(FENCE):
                lines.append(line.rstrip()[: -len(FENCE)])
                break
            lines.append(line)
            line = self.line(CONTINUATION_MARK)
        return "\n".join(lines).strip("\n")


def banner(llm: LLM, name: str) -> str:
    context = llm.package.context_length
    size = f"context {context} tokens" if context else "no stated context length"
    return (
        f"onnxgen chat: {name} ({size}). /help lists the commands, Ctrl-C stops an answer, Ctrl-D leaves; "
        f"{FENCE} opens and closes a multi-line message."
    )


def cut_off_mark(result: GenerationResult, session: ChatSession) -> str | None:
    """A line marking an answer that ended before end-of-sequence (``-n`` reached or the context full)."""
    if result.finish_reason != "length":
        return None
    generated = result.stats.get("generated_tokens", len(result.token_ids))
    if generated >= session.params.max_new_tokens:  # else the generator clipped it to the context's room
        return f"[answer cut off at -n {session.params.max_new_tokens} tokens]"
    return f"[answer cut off after {generated} tokens: the conversation fills the context; /reset clears it]"


def _answer_room(llm: LLM) -> int:
    return llm.package.context_length or NO_CONTEXT_LIMIT


def repl(session: ChatSession, *, show_stats: bool = False, source: _Input | None = None) -> int:
    source = source or _Input(sys.stdin.isatty())
    try:
        return _loop(session, source, show_stats)
    finally:
        source.save_history()


def _loop(session: ChatSession, source: _Input, show_stats: bool) -> int:
    while True:
        try:
            message = source.message()
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print("\n(Ctrl-D or /exit leaves)", file=sys.stderr)
            continue
        if message is None:
            return 0
        text = message.strip()
        if not text:
            continue
        if _COMMAND.match(text):
            if _command(session, text):
                return 0
            continue
        try:
            result = session.ask(text, sys.stdout)
        except KeyboardInterrupt:
            print("\n(answer stopped; the conversation goes on without this turn)", file=sys.stderr)
            continue
        except OnnxgenError as e:
            print(f"\nonnxgen chat: error: {e} (/reset clears the history)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        mark = cut_off_mark(result, session)
        if mark is not None:
            print(mark, file=sys.stderr)
        if show_stats:
            print(format_stats(result), file=sys.stderr)


def _command(session: ChatSession, text: str) -> bool:
    """Run the ``/command`` line ``text`` (never sent to the model); True where it leaves the REPL."""
    word, _, rest = text.partition(" ")
    if word in EXIT_COMMANDS:
        return True
    if word in RESET_COMMANDS:
        session.reset()
        print("(conversation cleared)", file=sys.stderr)
    elif word == "/help":
        print("\n".join(f"{k:8} {v}" for k, v in COMMANDS.items()), file=sys.stderr)
    elif word == "/set":
        name, _, value = rest.strip().removeprefix("parameter ").strip().partition(" ")
        try:
            print(f"({session.set(name.strip(), value.strip())})", file=sys.stderr)
        except ValueError as e:
            print(f"onnxgen chat: {e}", file=sys.stderr)
    else:
        print(f"unknown command {word}; /help lists the commands", file=sys.stderr)
    return False


def _run(args: argparse.Namespace) -> int:
    spec = speculative_from_args(args)
    sampling_params(args, SAMPLING_DEFAULTS)  # bad flags fail before the model loads
    llm = load_llm(args, speculative=spec is not None, log=terminal_log())
    check_chat_template(llm)  # a model that cannot chat is told now, not at the first message
    params = sampling_params(args, {**SAMPLING_DEFAULTS, "max_new_tokens": _answer_room(llm)})
    session = ChatSession(llm, params, system=args.system, speculative=spec)
    print(banner(llm, model_label(args.model or llm.package.root)), file=sys.stderr)
    return repl(session, show_stats=args.stats)
