"""The Python API as vLLM and transformers users call it: ``onnxgen.LLM(path)``, ``max_tokens``, lists where
one prompt is taken, messages given to ``generate``, a list of conversations for ``chat``, a Pydantic
model as ``json_schema`` and ``logit_bias``."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

import onnxgen
from onnxgen import GenerationError, SamplingParams
from onnxgen.llm import LLM, load
from onnxgen.testing import build_model

PROMPT = "the quick brown fox"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("api-habits"), "genai-dense")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return load(model_dir, threads=1)


def test_llm_of_a_path_loads_as_load_does(model_dir: Path, llm: LLM) -> None:
    expected = llm.generate(PROMPT, max_new_tokens=6).token_ids
    for made in (onnxgen.LLM(str(model_dir), threads=1), onnxgen.LLM(model=model_dir, threads=1)):
        assert made.generate(PROMPT, max_new_tokens=6).token_ids == expected
        assert made.config.threads == 1 and made.package.root == llm.package.root
    with pytest.raises(TypeError, match="model twice"):
        onnxgen.LLM(model_dir, model=model_dir)


def test_max_tokens_is_vllm_s_name_of_max_new_tokens(llm: LLM) -> None:
    assert SamplingParams(max_tokens=16) == SamplingParams(max_new_tokens=16)
    assert SamplingParams(max_tokens=16, max_new_tokens=16).max_new_tokens == 16
    with pytest.raises(ValueError, match=r"max_tokens must be equal to max_new_tokens \(8\)"):
        SamplingParams(max_tokens=16, max_new_tokens=8)
    result = llm.generate(PROMPT, max_tokens=5, ignore_eos=True)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    assert (
        llm.chat(USER, max_tokens=3, ignore_eos=True).token_ids
        == llm.chat(USER, max_new_tokens=3, ignore_eos=True).token_ids
    )


def test_a_list_where_one_prompt_is_taken_names_the_call_that_takes_a_list(llm: LLM) -> None:
    # llm.stream(["a", "b"]) used to fail deep inside with "invalid literal for int()"
    with pytest.raises(GenerationError, match=r"stream\(\) takes one prompt, not a list of 2; llm.generate"):
        llm.stream(["a", "b"])
    streamed = "".join(e.text for e in llm.stream("a", max_new_tokens=4))  # control: one prompt streams
    assert streamed == llm.generate("a", max_new_tokens=4).text


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_messages_given_to_generate_or_stream_name_llm_chat(llm: LLM, call: str) -> None:
    with pytest.raises(GenerationError, match=r"llm\.chat\(messages\)"):
        getattr(llm, call)(USER)
    with pytest.raises(GenerationError, match=r"llm\.chat\(messages\)"):
        getattr(llm, call)(USER[0])  # a lone message


def test_chat_takes_a_list_of_conversations_as_vllm_does(llm: LLM) -> None:
    conversations = [USER, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]]
    replies = llm.chat(conversations, max_new_tokens=5)
    assert isinstance(replies, list) and len(replies) == 2
    for conversation, reply in zip(conversations, replies, strict=True):
        alone = llm.chat(conversation, max_new_tokens=5)
        assert (reply.token_ids, reply.text, reply.finish_reason) == (
            alone.token_ids,
            alone.text,
            alone.finish_reason,
        )
    with pytest.raises(GenerationError, match=r"llm\.chat\(conversations\)"):
        llm.stream_chat(conversations)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


def test_a_pydantic_model_is_a_json_schema(llm: LLM) -> None:
    expected = json.dumps(Person.model_json_schema())
    assert json.loads(str(SamplingParams(json_schema=Person).json_schema)) == json.loads(expected)
    assert (
        SamplingParams(json_schema=Person(name="a", age=1)).json_schema
        == SamplingParams(json_schema=Person).json_schema
    )
    reply = llm.generate(PROMPT, json_schema=Person, max_new_tokens=60)
    assert reply.finish_reason == "stop"
    Person.model_validate_json(reply.text)  # valid, and (no extra keys) exactly the model's fields
    assert set(json.loads(reply.text)) == {"name", "age"}


def test_logit_bias_forces_or_bans_a_token_in_the_library(llm: LLM) -> None:
    plain = llm.generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids
    forced = llm.generate(PROMPT, max_new_tokens=4, ignore_eos=True, logit_bias={7: 100.0}).token_ids
    assert forced == [7] * 4 and plain != forced
    banned = llm.generate(PROMPT, max_new_tokens=4, ignore_eos=True, logit_bias={plain[0]: -100.0})
    assert banned.token_ids[0] != plain[0]
    with pytest.raises(GenerationError, match=r"logit_bias has token ids \[99999\] outside"):
        llm.generate(PROMPT, logit_bias={99999: 1.0})
