"""LLM.chat with tools and reasoning on tiny random-weight models (the worst case: the model wants garbage).

Under ``required`` or a named function every sampled reply must still be a schema-valid call; under
``auto`` anything that starts a call must be a valid call; a JSON schema must constrain only the answer
after the reasoning section.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

import onnxgen
from onnxgen import SamplingParams
from onnxgen.chat.tools import ChatInputError
from onnxgen.llm import LLM
from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.chat_templates import HERMES_TEMPLATE, XML_TEMPLATE, install_chat_template

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}
TEMPLATES = {"hermes": HERMES_TEMPLATE, "xml": XML_TEMPLATE}


@pytest.fixture(scope="module")
def llms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLM]:
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for name, template in TEMPLATES.items():
        path = build_model(root / name, "genai-dense", TinySpec(vocab_size=1024, max_position=1024))
        install_chat_template(path, template)
        out[name] = onnxgen.load(path, threads=1)
    return out


def sampled(seed: int, n: int = 200, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, **kw)


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_schema_valid_at_temperature_one(
    llms: dict[str, LLM], template: str, choice: str
) -> None:
    tool_choice = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    for seed in range(6):
        result = llms[template].chat(
            MESSAGES,
            sampled(seed),
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            chat_template_kwargs=NO_THINKING,
        )
        assert result.finish_reason == "tool_calls", (seed, result.text)
        assert result.content == "" and len(result.tool_calls) == 1, result.text
        call = result.tool_calls[0]
        assert choice == "required" or call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_without_tools_the_same_request_makes_no_call(llms: dict[str, LLM]) -> None:
    """Negative control: the calls above come from the grammar, not from the random model."""
    for seed in range(3):
        result = llms["hermes"].chat(MESSAGES, sampled(seed, 60), chat_template_kwargs=NO_THINKING)
        assert result.tool_calls == [] and result.finish_reason != "tool_calls"


def test_parallel_calls_are_each_valid(llms: dict[str, LLM]) -> None:
    result = llms["hermes"].chat(
        MESSAGES, sampled(1, 300), tools=TOOLS, tool_choice="required", chat_template_kwargs=NO_THINKING
    )
    assert len(result.tool_calls) >= 2, result.text  # the random model keeps calling until max tokens
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)
    for call in result.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("template", TEMPLATES)
def test_under_auto_anything_that_starts_a_call_is_a_valid_call(
    llms: dict[str, LLM], template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``<tool_call>`` made likely, the random model starts calls: without the grammar they are
    garbage (left in the content); with it every call it starts is valid (or cut short at the end)."""
    bias_token(monkeypatch, llms[template], "<tool_call>", 5.0)

    def run(constrain: bool) -> list[Any]:
        return [
            llms[template].chat(
                MESSAGES,
                sampled(seed, 150),
                tools=TOOLS,
                constrain_calls=constrain,
                chat_template_kwargs=NO_THINKING,
            )
            for seed in range(8)
        ]

    free = run(False)
    assert any("<tool_call>" in r.content for r in free)  # malformed calls happen without the grammar
    calls = 0
    for result in run(True):
        content = result.content
        if result.finish_reason == "length" and "</tool_call>" not in content.rsplit("<tool_call>", 1)[-1]:
            content = content.rsplit("<tool_call>", 1)[0]  # a call cut short by max_new_tokens
        assert "<tool_call>" not in content, result.text
        for call in result.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        calls += len(result.tool_calls)
    assert calls > 0


def test_streamed_chat_gives_the_same_call_as_chat(llms: dict[str, LLM]) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw: dict[str, Any] = dict(tools=TOOLS, tool_choice=named, chat_template_kwargs=NO_THINKING)
    whole = llms["xml"].chat(MESSAGES, sampled(4), **kw)
    events = list(llms["xml"].stream_chat(MESSAGES, sampled(4), **kw))
    assert "".join(e.text for e in events) == whole.text
    assert events[-1].finish_reason == "tool_calls" and events[-1].output is not None
    parts = [p for e in events for d in e.deltas for p in d.tool_calls]
    assert parts[0].name == whole.tool_calls[0].name and parts[0].id == events[-1].output.tool_calls[0].id
    assert "".join(p.arguments for p in parts) == whole.tool_calls[0].arguments
    assert len(parts) > 3  # the arguments came in pieces


def test_conflicting_constraints_are_refused(llms: dict[str, LLM]) -> None:
    with pytest.raises(ChatInputError, match="cannot be combined with regex"):
        llms["hermes"].chat(MESSAGES, SamplingParams(regex="a+"), tools=TOOLS, tool_choice="required")
    with pytest.raises(ChatInputError, match="not among the tools"):
        llms["hermes"].chat(
            MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
        )


# -- a JSON answer after free reasoning -------------------------------------------------------------
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def bias_token(monkeypatch: pytest.MonkeyPatch, llm: LLM, text: str, bias: float, after: int = 0) -> None:
    """Add ``bias`` to the logit of the token ``text`` from the ``after``-th decode step on."""
    token = llm.tokenizer.token_to_id(text) if llm.tokenizer else None
    assert token is not None
    inner = llm.session.step
    count = [0]

    def step(*args: Any, **kw: Any) -> np.ndarray:
        count[0] += 1
        logits = np.array(inner(*args, **kw))
        if count[0] >= after:
            logits[..., token] += bias
        return logits

    monkeypatch.setattr(llm.session, "step", step)


def test_a_json_schema_constrains_only_the_answer_after_the_reasoning(
    llms: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = llms["xml"]  # the prompt opens <think>: the reply starts inside the reasoning section
    bias_token(monkeypatch, llm, "</think>", 1e4, after=6)  # thinking ends at step 6
    for seed in range(4):
        result = llm.chat(MESSAGES, sampled(seed, json_schema=ANSWER))
        assert result.finish_reason == "stop", result.text
        assert result.reasoning and "</think>" in result.text  # the reasoning ran free until the bias
        jsonschema.validate(json.loads(result.content), ANSWER)
        with pytest.raises(ValueError):
            json.loads(result.reasoning)  # free text, not the schema's JSON
    # negative control: without the reasoning split the schema applies from the first token
    result = llm.chat(MESSAGES, sampled(0, json_schema=ANSWER), reasoning=False)
    assert "</think>" not in result.text and result.reasoning is None
    jsonschema.validate(json.loads(result.text), ANSWER)


def test_a_forced_call_follows_the_reasoning(llms: dict[str, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = llms["xml"]
    bias_token(monkeypatch, llm, "</think>", 1e4, after=4)
    result = llm.chat(MESSAGES, sampled(2), tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert result.finish_reason == "tool_calls" and result.reasoning
    jsonschema.validate(json.loads(result.tool_calls[0].arguments), SCHEMAS[result.tool_calls[0].name])


def test_the_model_directory_keeps_its_tag_tokens(llms: dict[str, LLM], tmp_path: Path) -> None:
    tok = llms["hermes"].tokenizer
    assert tok is not None
    ids = tok.encode("<tool_call>x</tool_call>", add_special_tokens=False)
    assert len(ids) == 3 and tok.decode(ids) == "<tool_call>x</tool_call>"  # one token each, kept in text
