"""``onnxgen chat``: a REPL on stdin that keeps the conversation, resets it, and survives a failed turn."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from onnxgen.cli import main
from onnxgen.generation.generator import StreamEvent
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import LLM, load
from onnxgen.testing import build_model

Messages = list[dict[str, Any]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("chat"), "hybrid-genai")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return load(model_dir, threads=1)


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[Messages]:
    """The messages of every turn the REPL sends to the model (a spy on LLM.stream_chat)."""
    calls: list[Messages] = []
    real = LLM.stream_chat

    def spy(
        self: LLM,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        speculative: Any = None,
    ) -> Iterator[StreamEvent]:
        calls.append([dict(m) for m in messages])
        return real(self, messages, params, speculative)

    monkeypatch.setattr(LLM, "stream_chat", spy)
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)
    return calls


def _chat(monkeypatch: pytest.MonkeyPatch, model_dir: Path, lines: str, *flags: str) -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    return main(["chat", str(model_dir), "-n", "6", "--temp", "0", "--threads", "1", *flags])


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_chat_keeps_the_first_exchange_in_the_second_prompt(
    model_dir: Path,
    llm: LLM,
    asked: list[Messages],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = llm.chat([_user("hello")], SamplingParams(max_new_tokens=6)).text
    assert _chat(monkeypatch, model_dir, "hello\nhow are you\n") == 0
    out = capsys.readouterr().out
    assert asked[0] == [_user("hello")]
    assert asked[1] == [_user("hello"), {"role": "assistant", "content": first}, _user("how are you")]
    second = llm.chat(asked[1], SamplingParams(max_new_tokens=6)).text
    assert out == f"{first}\n{second}\n"
    rendered = llm.tokenizer.apply_chat_template(asked[1], add_generation_prompt=True)  # type: ignore[union-attr]
    assert f"user\nhello<|im_end|>\n<|im_start|>assistant\n{first}<|im_end|>" in rendered


def test_chat_reset_forgets_the_turns_but_keeps_the_system_message(
    model_dir: Path,
    asked: list[Messages],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _chat(monkeypatch, model_dir, "hello\n/reset\nagain\n", "--system", "be brief") == 0
    system = {"role": "system", "content": "be brief"}
    assert asked == [[system, _user("hello")], [system, _user("again")]]
    assert "cleared" in capsys.readouterr().err


def test_chat_exit_command_and_end_of_input_end_the_repl_with_status_0(
    model_dir: Path,
    asked: list[Messages],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _chat(monkeypatch, model_dir, "hi\n/exit\nnever asked\n") == 0
    assert asked == [[_user("hi")]]
    assert _chat(monkeypatch, model_dir, "") == 0
    assert _chat(monkeypatch, model_dir, "\n   \nlast line without newline") == 0
    assert asked[1:] == [[_user("last line without newline")]]
    assert "Traceback" not in capsys.readouterr().err


def test_chat_reports_a_turn_past_the_context_and_goes_on_without_it(
    model_dir: Path,
    asked: list[Messages],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    too_long = " ".join(f"w{i}" for i in range(400))  # more tokens than the tiny model's 256 positions
    assert _chat(monkeypatch, model_dir, f"{too_long}\nhello\nagain\n", "--stats") == 0
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert len(errors) == 1 and "context" in errors[0] and "/reset" in errors[0]
    assert "Traceback" not in captured.err
    assert [m["content"] for m in asked[2] if m["role"] == "user"] == ["hello", "again"]
    assert captured.err.count("[onnxgen] prompt") == 2  # --stats: one line per completed answer


def test_chat_with_prompt_lookup_answers_as_plain_greedy_and_states_the_drafts(
    model_dir: Path,
    llm: LLM,
    asked: list[Messages],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = "abc abc abc abc abc"
    plain = llm.chat([_user(text)], SamplingParams(max_new_tokens=6)).text
    assert _chat(monkeypatch, model_dir, f"{text}\n", "--speculative", "prompt-lookup", "--stats") == 0
    captured = capsys.readouterr()
    assert captured.out == f"{plain}\n"
    assert "drafts " in captured.err and "target forwards" in captured.err


def test_chat_names_unknown_commands_and_sends_slash_text_with_spaces(
    model_dir: Path,
    asked: list[Messages],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _chat(monkeypatch, model_dir, "/foo\n/help\n/usr/bin is a folder\n") == 0
    err = capsys.readouterr().err
    assert "unknown command /foo; /help lists the commands" in err
    assert "/reset" in err and "/exit" in err  # /help
    assert asked == [[_user("/usr/bin is a folder")]]


def test_chat_reads_multi_line_messages(
    model_dir: Path, asked: list[Messages], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = '"""first line\n\nsecond line\n"""\none \\\ntwo\n"""inline"""\n'
    assert _chat(monkeypatch, model_dir, lines) == 0
    assert [turn[-1]["content"] for turn in asked] == ["first line\n\nsecond line", "one \ntwo", "inline"]


def test_chat_answers_run_to_the_context_by_default_and_a_cut_off_answer_is_marked(
    model_dir: Path, llm: LLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[SamplingParams] = []
    real = LLM.stream_chat

    def spy(self: LLM, messages: Any, params: SamplingParams | None = None, speculative: Any = None) -> Any:
        assert params is not None
        seen.append(params)
        return real(self, messages, params, speculative)

    monkeypatch.setattr(LLM, "stream_chat", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", str(model_dir), "--temp", "0", "--ignore-eos", "--threads", "1"]) == 0
    context = llm.package.context_length
    assert context is not None and seen[0].max_new_tokens == context
    err = capsys.readouterr().err
    assert "the conversation fills the context" in err  # --ignore-eos: it ran until the context was full
    assert f"context {context} tokens" in err and "/help" in err and str(model_dir) in err  # the banner
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", str(model_dir), "--temp", "0", "-n", "5", "--ignore-eos", "--threads", "1"]) == 0
    assert "[answer cut off at -n 5 tokens]" in capsys.readouterr().err


def test_chat_resumes_each_turn_from_the_cached_conversation_unless_the_cache_is_off(
    model_dir: Path,
    llm: LLM,
    asked: list[Messages],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import re

    assert _chat(monkeypatch, model_dir, "hello\nhow are you\n", "--stats") == 0
    cached = capsys.readouterr()
    first_prompt = len(llm.chat_prompt(asked[0]))
    lines = [line for line in cached.err.splitlines() if line.startswith("[onnxgen] prompt")]
    assert "cached" not in lines[0]
    resumed = re.search(r"\((\d+) cached\)", lines[1])
    assert resumed is not None and int(resumed.group(1)) >= first_prompt  # the first turn's prompt at least
    # and its reply: the REPL's turns cache the next turn's opening tokens, so the second turn prefills at
    # most its own message as a conversation of its own renders it
    second_prompt = len(llm.chat_prompt(asked[1]))
    assert int(resumed.group(1)) >= second_prompt - len(llm.chat_prompt([_user("how are you")]))
    assert _chat(monkeypatch, model_dir, "hello\nhow are you\n", "--stats", "--prefix-cache-mb", "0") == 0
    plain = capsys.readouterr()
    assert plain.out == cached.out  # the same answers
    assert "cached" not in plain.err
