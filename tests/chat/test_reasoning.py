"""The reasoning split, whole and streamed (tags cut across chunks), and with tool calls after it."""

from __future__ import annotations

import pytest

from onnxgen.chat.deltas import ChatDelta
from onnxgen.chat.output import ChatStream, parse_output
from onnxgen.chat.parsers import PARSERS
from onnxgen.chat.reasoning import ReasoningFormat, reasoning_opened
from onnxgen.chat.tools import parse_tools
from onnxgen.testing import tiny_tokenizer
from onnxgen.testing.chat_templates import HERMES_TEMPLATE, XML_TEMPLATE
from onnxgen.tokenizer import Tokenizer

THINK = ReasoningFormat()
CASES = {  # (opened in the prompt, reply) -> (reasoning, answer)
    "opened in the prompt": (
        True,
        "Let me see: 2+2.\n</think>\n\nIt is 4.",
        ("Let me see: 2+2.", "It is 4."),
    ),
    "opened by the model": (False, "<think>\nhmm <b> </thin\n</think>\n\n4", ("hmm <b> </thin", "4")),
    "opened by the model after whitespace": (False, "\n<think>a</think>b", ("a", "b")),
    "no thinking": (False, "Just the answer, <think> inside.", (None, "Just the answer, <think> inside.")),
    "empty thinking": (False, "<think>\n\n</think>\n\nok", ("", "ok")),
    "cut short while thinking": (True, "step 1\nstep 2\n", ("step 1\nstep 2", "")),
    "answer keeps inner layout": (True, "r</think>\n\nline 1\n\nline 2\n", ("r", "line 1\n\nline 2\n")),
}


def streamed(opened: bool, chunks: list[str]) -> tuple[str | None, str, list[ChatDelta]]:
    stream = THINK.stream(opened)
    deltas: list[ChatDelta] = []
    for chunk in chunks:
        deltas += stream.feed(chunk)
    deltas += stream.finish()
    return stream.reasoning, stream.content, deltas


@pytest.mark.parametrize("case", CASES)
def test_replies_split_into_reasoning_and_answer(case: str) -> None:
    opened, text, expected = CASES[case]
    assert THINK.parse(text, opened) == expected


@pytest.mark.parametrize("case", CASES)
def test_streaming_agrees_with_whole_text_at_every_split_point(case: str) -> None:
    opened, text, expected = CASES[case]
    for cut in range(len(text) + 1):
        reasoning, content, deltas = streamed(opened, [text[:cut], text[cut:]])
        assert (reasoning, content) == expected, cut
        assert "".join(d.reasoning for d in deltas) == (reasoning or "")
        assert "".join(d.content for d in deltas) == content
        assert all(bool(d.reasoning) != bool(d.content) for d in deltas)  # separate deltas
    assert streamed(opened, list(text))[:2] == expected


def test_reasoning_streams_before_the_end_tag_arrives() -> None:
    stream = THINK.stream(opened=True)
    assert stream.feed("first thoughts ") == [ChatDelta(reasoning="first thoughts")]  # trailing space held
    assert stream.feed("and more</th") == [ChatDelta(reasoning=" and more")]
    assert stream.feed("ink>\n\nAnswer") == [ChatDelta(content="Answer")]


def test_the_rendered_prompt_tells_whether_the_reply_starts_inside_the_section() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "?"},
    ]
    xml = Tokenizer(tiny_tokenizer(512), {}, XML_TEMPLATE)
    hermes = Tokenizer(tiny_tokenizer(512), {}, HERMES_TEMPLATE)
    assert reasoning_opened(xml.apply_chat_template(messages))  # earlier turns closed theirs
    assert not reasoning_opened(xml.apply_chat_template(messages, enable_thinking=False))
    assert not reasoning_opened(hermes.apply_chat_template(messages))
    assert not reasoning_opened(hermes.apply_chat_template(messages, enable_thinking=False))


TOOLS = parse_tools(
    [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"q": {"type": "string"}}}}}]
)
REPLY = "I should call f.\n<tool_call> is the tag.\n</think>\n\nCalling.\n<tool_call>\n<function=f>\n<parameter=q>\nx y\n</parameter>\n</function>\n</tool_call>"


def test_tool_calls_are_parsed_after_the_reasoning_only() -> None:
    out = parse_output(REPLY, THINK, True, PARSERS["qwen3_coder"], TOOLS)
    assert out.reasoning == "I should call f.\n<tool_call> is the tag."
    assert out.content == "Calling."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"q": "x y"}')]
    for cut in range(len(REPLY) + 1):
        stream = ChatStream(THINK, True, PARSERS["qwen3_coder"], TOOLS)
        deltas = stream.feed(REPLY[:cut]) + stream.feed(REPLY[cut:]) + stream.finish()
        got = stream.output
        assert (got.reasoning, got.content) == (out.reasoning, out.content), cut
        assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"q": "x y"}')], cut
        kinds = ["r" if d.reasoning else "c" if d.content else "t" for d in deltas]
        assert kinds == sorted(kinds, key="rct".index)  # reasoning, then content, then the call


def test_without_parsers_the_reply_is_all_content() -> None:
    out = parse_output("<think>x</think>y")
    assert (out.content, out.reasoning, out.tool_calls) == ("<think>x</think>y", None, [])
