"""Tool-call grammars and the reasoning gate, checked with llguidance alone (no model): which replies
they accept and which they refuse, with tags spelled out and with tags as single tokens."""

from __future__ import annotations

import json
from collections.abc import Callable

import llguidance as llg
import pytest
import tokenizers

from onnxgen.chat.grammar import quoted, tool_call_grammar
from onnxgen.chat.parsers import PARSERS
from onnxgen.chat.tools import ToolChoice, parse_tools
from onnxgen.generation.constraints import JSON_OPTIONS
from onnxgen.generation.params import ReasoningSection
from onnxgen.generation.reasoning_gate import after_reasoning
from onnxgen.testing import tiny_tokenizer
from onnxgen.testing.chat_templates import TAG_TOKENS

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 8},
                        "days": {"type": "integer", "minimum": 1},
                        "unit": {"enum": ["c", "f"]},
                    },
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        },
        {
            "type": "function",
            "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
        },
    ]
)
Matcher = Callable[[str], bool]


def matcher(grammar: str, tag_tokens: bool) -> Matcher:
    tok = tiny_tokenizer(1024)
    if tag_tokens:
        tok.add_tokens(list(TAG_TOKENS))
    table = llg.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=0)
    compiled = llg.LLMatcher(table, grammar)
    assert not compiled.is_error(), compiled.get_error()

    def accepts(text: str) -> bool:
        m = compiled.deep_copy()
        ids = tok.encode(text).ids
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    return accepts


def literal_for(tag_tokens: bool) -> Callable[[str], str]:
    if not tag_tokens:
        return quoted
    tok: tokenizers.Tokenizer = tiny_tokenizer(1024)
    tok.add_tokens(list(TAG_TOKENS))
    return lambda text: f"<[{tok.token_to_id(text)}]>" if text in TAG_TOKENS else quoted(text)


def grammar(parser: str, choice: ToolChoice, tag_tokens: bool, parallel: bool = True) -> Matcher:
    lark = tool_call_grammar(PARSERS[parser], TOOLS, choice, parallel, literal_for(tag_tokens))
    assert lark is not None
    return matcher(llg.LLMatcher.grammar_from_lark(lark), tag_tokens)


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("tag_tokens", [False, True])
def test_hermes_required_accepts_valid_calls_only(tag_tokens: bool) -> None:
    accepts = grammar("hermes", ToolChoice("required"), tag_tokens)
    assert accepts(hermes("get_weather", '{"city": "Paris", "days": 2}'))
    assert accepts(hermes("noop", "{}") + "\n" + hermes("get_weather", '{"city": "Oslo", "unit": "c"}'))
    assert not accepts("Sure! " + hermes("noop", "{}"))  # required: nothing but calls
    assert not accepts(hermes("rm_rf", "{}"))
    assert not accepts(hermes("get_weather", '{"days": 2}'))  # city is required
    assert not accepts(hermes("get_weather", '{"city": "Paris", "days": 0}'))  # minimum 1
    assert not accepts(hermes("get_weather", '{"city": "Paris", "x": 1}'))  # no additional properties
    assert not accepts(hermes("noop", "{}") + " and text")
    assert not accepts("")


@pytest.mark.parametrize("tag_tokens", [False, True])
def test_named_and_single_call_choices_restrict_the_calls(tag_tokens: bool) -> None:
    named = grammar("hermes", ToolChoice("named", "noop"), tag_tokens)
    assert named(hermes("noop", "{}"))
    assert not named(hermes("get_weather", '{"city": "Paris"}'))
    assert not named(hermes("noop", "{}") + "\n" + hermes("noop", "{}"))
    single = grammar("qwen3_coder", ToolChoice("required"), tag_tokens, parallel=False)
    assert single(xml("noop"))
    assert not single(xml("noop") + "\n" + xml("noop"))


@pytest.mark.parametrize("tag_tokens", [False, True])
def test_xml_required_follows_the_parameter_schemas(tag_tokens: bool) -> None:
    accepts = grammar("qwen3_coder", ToolChoice("required"), tag_tokens)
    assert accepts(xml("get_weather", city="San Jose", days="3", unit="f"))
    assert accepts(xml("get_weather", city="a\nb"))  # optional parameters may be left out
    assert accepts(xml("noop") + "\n" + xml("get_weather", city=""))
    assert not accepts(xml("get_weather", city="Llanfairpwll"))  # maxLength 8
    assert not accepts(xml("get_weather", city="x", days="three"))  # an integer parameter
    assert not accepts(xml("get_weather", city="x", unit="k"))  # not in the enum
    assert not accepts(xml("get_weather", unit="c", city="x"))  # parameters in schema order
    assert not accepts(xml("get_weather", days="1"))  # city is required
    assert not accepts(xml("nope"))


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("tag_tokens", [False, True])
def test_auto_allows_text_or_text_then_valid_calls(parser: str, tag_tokens: bool) -> None:
    accepts = grammar(parser, ToolChoice("auto"), tag_tokens)
    call = hermes("noop", "{}") if parser == "hermes" else xml("noop")
    assert accepts("It is sunny, no need for tools. <b>bold</b>")
    assert accepts("")
    assert accepts("Let me check.\n\n" + call)
    assert not accepts("text <tool_call> garbage")  # a started call must be a valid call
    assert not accepts(call.replace("noop", "nope"))
    assert not accepts(call + "\ntrailing text")


def test_none_builds_no_grammar() -> None:
    assert tool_call_grammar(PARSERS["hermes"], TOOLS, ToolChoice("none")) is None


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def gated(section: ReasoningSection, tag_tokens: bool) -> Matcher:
    inner = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    return matcher(after_reasoning(inner, section, literal_for(tag_tokens)), tag_tokens)


@pytest.mark.parametrize("tag_tokens", [False, True])
def test_an_opened_reasoning_section_is_free_then_the_answer_is_constrained(tag_tokens: bool) -> None:
    accepts = gated(ReasoningSection(opened=True), tag_tokens)
    assert accepts('hmm, {"a": "x"} is not it\n</think>\n\n{"a": 12}')
    assert accepts('</think>{"a": 1}')
    assert not accepts('thinking</think>\n\n{"a": "12"}')  # the answer follows the schema
    assert not accepts('{"a": 1}')  # the section must end first
    assert not accepts('x</think>{"a": 1} and more')


@pytest.mark.parametrize("tag_tokens", [False, True])
def test_a_section_the_model_may_open_is_optional(tag_tokens: bool) -> None:
    accepts = gated(ReasoningSection(opened=False), tag_tokens)
    assert accepts('{"a": 1}')
    assert accepts('<think>\nfree text {\n</think>\n\n{"a": 1}')
    assert not accepts('free text {"a": 1}')  # outside a section the schema applies from the start
