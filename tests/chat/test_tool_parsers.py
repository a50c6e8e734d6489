"""Tool-call parsers on tricky replies: whole text, and streamed in every chunking.

Streamed and whole-text parses must agree wherever the text is cut (the stream holds back partial tags);
malformed calls come back as content, never as an exception.
"""

from __future__ import annotations

import json

import pytest

from onnxgen.chat.deltas import ChatDelta
from onnxgen.chat.parsers import PARSERS, ToolParser, tool_parser_for
from onnxgen.chat.tools import ChatInputError, Tool, ToolCall, parse_tools
from onnxgen.testing.chat_templates import HERMES_TEMPLATE, XML_TEMPLATE

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "opts": {"type": "object"},
                        "note": {"type": ["string", "null"]},
                    },
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "noop"}},
    ]
)
HERMES = PARSERS["hermes"]
XML = PARSERS["qwen3_coder"]
Summary = tuple[str, list[tuple[str, str]]]


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def stream(
    parser: ToolParser, chunks: list[str], tools: list[Tool] | None = TOOLS
) -> tuple[str, list[ToolCall], list[ChatDelta]]:
    parsing = parser.stream(tools)
    deltas: list[ChatDelta] = []
    for chunk in chunks:
        deltas += parsing.feed(chunk)
    deltas += parsing.finish()
    return parsing.content, parsing.calls, deltas


def summary(content: str, calls: list[ToolCall]) -> Summary:
    return content, [(c.name, c.arguments) for c in calls]


def check_deltas(content: str, calls: list[ToolCall], deltas: list[ChatDelta]) -> None:
    """The deltas rebuild the result: content joined; each call's first piece has its id and name only,
    the later ones pieces of its arguments."""
    assert "".join(d.content for d in deltas) == content
    pieces: dict[int, list[str]] = {}
    for delta in deltas:
        for part in delta.tool_calls:
            if part.index not in pieces:
                call = calls[part.index]
                assert (part.id, part.name, part.arguments) == (call.id, call.name, "")
                pieces[part.index] = []
            else:
                assert part.id is None and part.name is None
                pieces[part.index].append(part.arguments)
    assert ["".join(pieces[i]) for i in sorted(pieces)] == [c.arguments for c in calls]


HERMES_CASES: dict[str, tuple[str, Summary]] = {
    "one call after text": (
        "Let me look.\n\n" + hermes_call("get_weather", '{"city": "Paris", "days": 3}'),
        ("Let me look.", [("get_weather", '{"city": "Paris", "days": 3}')]),
    ),
    "nested braces and braces in strings": (
        hermes_call("get_weather", '{"city": "a}b{c\\"}", "opts": {"x": [1, {"y": "]}"}], "z": {}}}'),
        ("", [("get_weather", '{"city": "a}b{c\\"}", "opts": {"x": [1, {"y": "]}"}], "z": {}}}')]),
    ),
    "several calls": (
        hermes_call("noop", "{}") + "\n" + hermes_call("get_weather", '{"city": "Oslo"}') + "\n",
        ("", [("noop", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ),
    "arguments given as a JSON string": (
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>',
        ("", [("get_weather", '{"city": "Rome"}')]),
    ),
    "parameters instead of arguments, before the name": (
        '<tool_call>\n{"parameters": {"city": "Lima"}, "name": "get_weather"}\n</tool_call>',
        ("", [("get_weather", '{"city": "Lima"}')]),
    ),
    "no arguments member and no layout newlines": (
        '<tool_call>{"name": "noop"}</tool_call>',
        ("", [("noop", "{}")]),
    ),
    "text around a call": (
        "Über " + hermes_call("get_weather", '{"city": "Zürich 🌧"}') + "\n\ndone.\n",
        ("Über\n\ndone.", [("get_weather", '{"city": "Zürich 🌧"}')]),
    ),
    "lone angle brackets and no call": ("a < b and <tool stays\n", ("a < b and <tool stays\n", [])),
}

MALFORMED_HERMES = {
    "unknown tool": hermes_call("rm_rf", "{}"),
    "not JSON": "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    "array arguments": hermes_call("get_weather", "[1, 2]"),
    "name is not a string": '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
    "no name": '<tool_call>\n{"arguments": {"city": "x"}}\n</tool_call>',
    "broken arguments": hermes_call("get_weather", '{"city": }'),
    "garbage before the end tag": hermes_call("noop", "{}").replace("}\n</tool_call>", "} oops </tool_call>"),
    "trailing comma": '<tool_call>\n{"name": "noop", "arguments": {},}\n</tool_call>',
}


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_replies_parse_into_content_and_calls(case: str) -> None:
    text, expected = HERMES_CASES[case]
    content, calls = HERMES.parse(text, TOOLS)
    assert summary(content, calls) == expected
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


def assert_streams_like_whole_text(parser: ToolParser, text: str, expected: Summary) -> None:
    """Cut in two at every point, and one character at a time: the same content and calls, and deltas
    that rebuild them."""
    for chunks in [*([text[:cut], text[cut:]] for cut in range(len(text) + 1)), list(text)]:
        content, calls, deltas = stream(parser, chunks)
        assert summary(content, calls) == expected, chunks
        check_deltas(content, calls, deltas)


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_streaming_agrees_with_whole_text_at_every_split_point(case: str) -> None:
    assert_streams_like_whole_text(HERMES, *HERMES_CASES[case])


@pytest.mark.parametrize("case", MALFORMED_HERMES)
def test_malformed_hermes_calls_come_back_as_content(case: str) -> None:
    text = MALFORMED_HERMES[case]
    assert HERMES.parse(text, TOOLS) == (text, [])
    assert summary(*stream(HERMES, [text])[:2]) == (text, [])  # one chunk sees the fault first


CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'


def test_a_call_cut_by_the_token_limit_is_dropped_whole_and_by_a_holding_stream_at_every_split() -> None:
    done = hermes_call("noop", "{}")
    for text, calls in ((CUT, []), ("Hi.\n" + done + "\n" + CUT, [("noop", "{}")])):
        expected = (text[: text.find("<tool_call>")].rstrip(), calls)
        assert summary(*HERMES.parse(text, TOOLS)) == expected  # no fragment as content
        for cut in range(len(text) + 1):
            parser = HERMES.stream(TOOLS, hold_calls=True)
            deltas = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
            assert summary(parser.content, parser.calls) == expected, cut
            check_deltas(parser.content, parser.calls, deltas)  # no delta of the dropped call was sent
    # negative control: the stream that sends arguments as they come keeps the call it committed
    assert [c.name for c in stream(HERMES, [CUT])[1]] == ["get_weather"]


def test_a_holding_stream_sends_each_call_whole_once_complete() -> None:
    text = hermes_call("get_weather", '{"city": "Paris"}')
    parser = HERMES.stream(TOOLS, hold_calls=True)
    assert parser.feed(text[: -len("</tool_call>")]) == []  # the call is not complete yet
    deltas = parser.feed(text[-len("</tool_call>") :]) + parser.finish()
    parts = [part for delta in deltas for part in delta.tool_calls]
    assert parts[0].name == "get_weather" and "".join(p.arguments for p in parts) == '{"city": "Paris"}'


def test_a_malformed_block_does_not_hide_a_valid_call_after_it() -> None:
    text = "<tool_call>\nnot json\n" + hermes_call("noop", "{}")
    for cut in range(len(text) + 1):
        content, calls, _ = stream(HERMES, [text[:cut], text[cut:]])
        assert summary(content, calls) == ("<tool_call>\nnot json", [("noop", "{}")]), cut


def test_a_streamed_call_committed_before_its_fault_keeps_what_was_streamed() -> None:
    """The documented limit of streaming: once the name is sent the call cannot be taken back."""
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}'
    content, calls, deltas = stream(HERMES, [head, " oops </tool_call>"])
    assert summary(content, calls) == ("oops </tool_call>", [("get_weather", '{"city": "Paris"}')])
    check_deltas(content, calls, deltas)
    cut_short, calls, _ = stream(HERMES, ['<tool_call>\n{"name": "noop", "arguments": {"a": '])
    assert (cut_short, [(c.name, c.arguments) for c in calls]) == ("", [("noop", '{"a": ')])


def test_without_a_tool_list_any_well_formed_name_is_a_call() -> None:
    content, calls = HERMES.parse(hermes_call("anything_goes", '{"k": 1}'), None)
    assert summary(content, calls) == ("", [("anything_goes", '{"k": 1}')])
    assert HERMES.parse(hermes_call("bad name!", "{}"), None)[1] == []


XML_CASES: dict[str, tuple[str, Summary]] = {
    "typed parameters": (
        "Checking.\n\n" + xml_call("get_weather", city="San Francisco", days="3", opts='{"u": [1, 2]}'),
        ("Checking.", [("get_weather", '{"city": "San Francisco", "days": 3, "opts": {"u": [1, 2]}}')]),
    ),
    "multi-line text with quotes, tags and braces": (
        xml_call("get_weather", city='line "1"\n<b>}{</b>\n  indented'),
        ("", [("get_weather", '{"city": "line \\"1\\"\\n<b>}{</b>\\n  indented"}')]),
    ),
    "several calls, one without parameters": (
        xml_call("noop") + "\n" + xml_call("get_weather", city="Oslo", note="null"),
        ("", [("noop", "{}"), ("get_weather", '{"city": "Oslo", "note": "null"}')]),
    ),
    "a non-JSON value of a typed parameter stays text; an undeclared one is text": (
        xml_call("get_weather", city="x", days="three", extra="7"),
        ("", [("get_weather", '{"city": "x", "days": "three", "extra": "7"}')]),
    ),
    "values without layout newlines": (
        "<tool_call><function=get_weather><parameter=city>Nice</parameter><parameter=days>2</parameter>"
        "</function></tool_call>",
        ("", [("get_weather", '{"city": "Nice", "days": 2}')]),
    ),
}

MALFORMED_XML = {
    "unknown function": xml_call("rm_rf"),
    "no function tag": '<tool_call>\n{"name": "noop"}\n</tool_call>',
    "text between parameters": xml_call("get_weather", city="x").replace(
        "</parameter>\n", "</parameter>\nhm\n"
    ),
    "unclosed parameter": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    "a newline inside the function name": "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("case", XML_CASES)
def test_xml_replies_parse_and_stream_alike_at_every_split_point(case: str) -> None:
    text, expected = XML_CASES[case]
    content, calls = XML.parse(text, TOOLS)
    assert summary(content, calls) == expected
    assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
    assert_streams_like_whole_text(XML, text, expected)


def test_xml_text_values_stream_before_the_parameter_closes() -> None:
    parsing = XML.stream(TOOLS)
    parsing.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fr")
    deltas = parsing.feed("ancisco\n</param")
    assert "".join(p.arguments for d in deltas for p in d.tool_calls) == "ancisco"  # the newline is held
    deltas = parsing.feed("eter>\n</function>\n</tool_call>") + parsing.finish()
    assert "".join(p.arguments for d in deltas for p in d.tool_calls) == '"}'
    assert parsing.calls[0].arguments == '{"city": "San Francisco"}'


@pytest.mark.parametrize("case", MALFORMED_XML)
def test_malformed_xml_calls_come_back_as_content(case: str) -> None:
    text = MALFORMED_XML[case]
    assert XML.parse(text, TOOLS) == (text, [])


def test_the_parser_is_chosen_by_name_or_from_the_template() -> None:
    assert tool_parser_for(template=HERMES_TEMPLATE) is HERMES
    assert tool_parser_for(template=XML_TEMPLATE) is XML
    assert tool_parser_for(template="{{ messages }}") is None
    assert tool_parser_for("qwen3_xml", template=HERMES_TEMPLATE) is XML  # a name wins over the template
    with pytest.raises(ChatInputError, match=r"unknown tool-call parser 'llama3'.*hermes"):
        tool_parser_for("llama3")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        *((HERMES, text) for text, _ in HERMES_CASES.values()),
        *((HERMES, text) for text in MALFORMED_HERMES.values()),
        (HERMES, "Hi.\n" + hermes_call("noop", "{}") + "\n" + CUT),
        *((XML, text) for text, _ in XML_CASES.values()),
        *((XML, text) for text in MALFORMED_XML.values()),
    ],
)
def test_a_holding_stream_reads_every_reply_as_the_whole_text_at_every_split(
    parser: ToolParser, text: str
) -> None:
    expected = summary(*parser.parse(text, TOOLS))
    for chunks in [*([text[:cut], text[cut:]] for cut in range(len(text) + 1)), list(text)]:
        held = parser.stream(TOOLS, hold_calls=True)
        deltas = [d for chunk in chunks for d in held.feed(chunk)] + held.finish()
        assert summary(held.content, held.calls) == expected, chunks
        check_deltas(held.content, held.calls, deltas)
