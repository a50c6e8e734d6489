"""``onnxgen chat`` in a terminal (a pseudo-terminal): Ctrl-C stops the answer being written and the
conversation goes on without that turn; lines go to the readline history file."""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

import onnxgen
from onnxgen.generation.params import SamplingParams

pty = pytest.importorskip("pty")

SRC = str(Path(onnxgen.__file__).resolve().parent.parent)
NEW_TOKENS = 600  # long enough that the answer is still being written when Ctrl-C arrives


class Terminal:
    """A child process on a pseudo-terminal: what it wrote so far, and keys to send it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so Ctrl-C is a SIGINT
            # a test run started in the background by a non-interactive shell inherits SIGINT ignored,
            # and Python keeps an ignored SIGINT ignored: give the child a terminal user's Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, *argv], env)
        self.text = ""

    def read_until(self, pattern: str, start: int, timeout: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (match := re.compile(pattern, re.DOTALL).search(self.text, start)) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.text[start:]!r}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    self.text += os.read(self.fd, 65536).decode("utf-8", "replace").replace("\r\n", "\n")
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"no {pattern!r} in {self.text[start:]!r}") from None
        return match

    def send(self, keys: str) -> int:
        """Type ``keys``; the position in the output from which their effect shows."""
        position = len(self.text)
        os.write(self.fd, keys.encode())
        return position

    def wait(self, timeout: float = 60.0) -> int:
        """The child's exit code; a child still running after ``timeout`` is killed and fails the test."""
        deadline = time.monotonic() + timeout
        while (done := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                os.close(self.fd)
                raise AssertionError(f"the chat did not exit; it wrote {self.text[-500:]!r}")
            time.sleep(0.05)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(done[1])


def test_ctrl_c_stops_the_answer_and_the_conversation_goes_on_without_it(tmp_path: Path) -> None:
    history = tmp_path / "history"
    env = {"PYTHONPATH": SRC, "ONNXGEN_CHAT_HISTORY": str(history), "TERM": "dumb", "HOME": str(tmp_path)}
    argv = ["-m", "onnxgen", "chat", "--temp", "0", "--ignore-eos", "-n", str(NEW_TOKENS), "--threads", "1"]
    term = Terminal(argv, env)
    term.read_until(r"/help.*?\n>>> ", 0)
    start = term.send("def first():\n")
    term.read_until(r"def first\(\):\n.+", start)  # the answer has begun
    start = term.send("\x03")
    term.read_until(r"\(answer stopped; the conversation goes on without this turn\)\n>>> ", start)
    start = term.send("def second():\n")
    done = term.read_until(r"def second\(\):\n(.*?)\n\[answer cut off at -n \d+ tokens\]\n>>> ", start)
    answer = done[1]
    start = term.send("/nope\n")
    # wait for the prompt: a Ctrl-D typed before readline has the terminal is lost when it takes it
    term.read_until(r"unknown command /nope.*?>>> ", start)
    term.send("\x04")  # Ctrl-D at the prompt leaves
    assert term.wait() == 0
    assert "Traceback" not in term.text
    # the second answer is the answer to a conversation without the stopped turn
    llm = onnxgen.load(threads=1)
    fresh = llm.chat(
        [{"role": "user", "content": "def second():"}],
        SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
    )
    assert answer == fresh.text.replace("\r\n", "\n")
    assert history.read_text().splitlines()[-3:] == ["def first():", "def second():", "/nope"]
