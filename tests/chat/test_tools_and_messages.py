"""Tool definitions, tool_choice and chat messages with tool calls: accepted forms, clear refusals, and
what chat templates receive."""

from __future__ import annotations

from typing import Any

import pytest

from onnxgen.chat.messages import template_messages
from onnxgen.chat.tools import MAX_TOOLS, ChatInputError, Tool, ToolChoice, parse_tool_choice, parse_tools
from onnxgen.testing import tiny_tokenizer
from onnxgen.testing.chat_templates import HERMES_TEMPLATE, XML_TEMPLATE
from onnxgen.tokenizer import Tokenizer

CHAT_TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}
FLAT_TOOL = {
    "type": "function",
    "name": "g",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
}


def test_both_tool_forms_and_tool_objects_are_read() -> None:
    tools = parse_tools([CHAT_TOOL, FLAT_TOOL, Tool("h")])
    assert [t.name for t in tools] == ["f", "g", "h"]
    assert tools[0].description == "d" and tools[1].properties == {"x": {"type": "integer"}}
    assert tools[2].to_openai() == {
        "type": "function",
        "function": {"name": "h", "parameters": {"type": "object", "properties": {}}},
    }


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ([{"type": "web_search"}], r"tools\[0\] must be a function tool"),
        ([{"type": "function", "function": {"name": "bad name"}}], r"tools\[0\] has the name 'bad name'"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            r"tools\[0\]\.parameters must be",
        ),
        ([CHAT_TOOL, CHAT_TOOL], "defines 'f' twice"),
        ([Tool(f"t{i}") for i in range(MAX_TOOLS + 1)], f"at most {MAX_TOOLS} tools"),
        ("f", "tools must be a list"),
    ],
)
def test_malformed_tools_are_refused_with_the_field(tools: Any, match: str) -> None:
    with pytest.raises(ChatInputError, match=match):
        parse_tools(tools)


def test_tool_choice_forms() -> None:
    tools = parse_tools([CHAT_TOOL, FLAT_TOOL])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools).forces_call
    assert parse_tool_choice({"type": "function", "function": {"name": "g"}}, tools) == ToolChoice(
        "named", "g"
    )
    assert parse_tool_choice({"type": "function", "name": "f"}, tools) == ToolChoice(
        "named", "f"
    )  # Responses form
    with pytest.raises(ChatInputError, match="not among the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "zz"}}, tools)
    with pytest.raises(ChatInputError, match="the request defines no tools"):
        parse_tool_choice("required", [])
    with pytest.raises(ChatInputError, match="tool_choice must be one of"):
        parse_tool_choice("always", tools)


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning": "Two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def test_tool_call_arguments_become_objects_and_tool_results_get_the_call_name() -> None:
    messages = template_messages(CONVERSATION)
    assert "content" not in messages[1]  # None values are dropped
    assert messages[1]["reasoning_content"] == "Two calls."
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [
        {"city": "Paris", "days": 2},
        {},
    ]
    assert messages[2]["name"] == messages[3]["name"] == "get_weather"
    assert (
        CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'
    )  # not mutated


def test_invalid_argument_json_is_refused_naming_the_call() -> None:
    bad = [
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}
    ]
    with pytest.raises(
        ChatInputError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"
    ):
        template_messages(bad)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            HERMES_TEMPLATE,
            '<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
            "rain\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            XML_TEMPLATE,
            "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n"
            "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n",
        ),
    ],
)
def test_a_tool_round_trip_renders_through_the_template(template: str, expected: str) -> None:
    tokenizer = Tokenizer(tiny_tokenizer(512), {}, template)
    tools = parse_tools(
        [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    )
    prompt = tokenizer.apply_chat_template(CONVERSATION, tools=tools)
    assert prompt.endswith(expected)
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]  # the tool list is in the system turn


@pytest.mark.external
@pytest.mark.parametrize("template", [HERMES_TEMPLATE, XML_TEMPLATE], ids=["hermes", "xml"])
def test_tool_conversations_render_like_hf_transformers(tmp_path: Any, template: str) -> None:
    """HF renders from argument objects; onnxgen accepts OpenAI's JSON text and renders the same."""
    transformers = pytest.importorskip("transformers")
    tok = tiny_tokenizer(512)
    tok.save(str(tmp_path / "tokenizer.json"))
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(tok, {}, template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    hf_messages = template_messages(CONVERSATION)  # HF expects the objects
    for kwargs in ({}, {"enable_thinking": False}):
        expected = theirs.apply_chat_template(
            hf_messages,
            chat_template=template,
            tokenize=False,
            tools=tools,
            add_generation_prompt=True,
            **kwargs,
        )
        assert ours.apply_chat_template(CONVERSATION, tools=tools, **kwargs) == expected
