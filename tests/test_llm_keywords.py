"""``llm.generate("hi", max_new_tokens=5, temperature=0.7)``: SamplingParams fields as keywords of
generate, stream, chat and stream_chat, and a clear TypeError for an unknown keyword or both forms."""

from __future__ import annotations

import pytest

from onnxgen import SamplingParams
from onnxgen.llm import LLM, load
from onnxgen.testing import build_model

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return load(build_model(tmp_path_factory.mktemp("kw"), "hybrid-genai"), threads=1)


def test_generate_and_stream_take_sampling_fields_as_keywords(llm: LLM) -> None:
    fields = {"max_new_tokens": 6, "temperature": 0.9, "top_k": 20, "seed": 5, "ignore_eos": True}
    expected = llm.generate("the fox", SamplingParams(**fields))
    got = llm.generate("the fox", **fields)
    assert got.token_ids == expected.token_ids and len(got.token_ids) == 6
    assert llm.generate("the fox", **{**fields, "seed": 6}).token_ids != expected.token_ids  # the seed took
    streamed = [i for event in llm.stream("the fox", **fields) for i in event.token_ids]
    assert streamed == expected.token_ids
    assert len(llm.generate("the fox", max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_chat_and_stream_chat_take_sampling_fields_beside_chat_options(llm: LLM) -> None:
    expected = llm.chat(USER, SamplingParams(max_new_tokens=5, temperature=0.8, seed=2))
    got = llm.chat(USER, max_new_tokens=5, temperature=0.8, seed=2, parallel_tool_calls=True)
    assert got.token_ids == expected.token_ids and got.text == expected.text
    streamed = [
        i
        for event in llm.stream_chat(USER, max_new_tokens=5, temperature=0.8, seed=2)
        for i in event.token_ids
    ]
    assert streamed == expected.token_ids


@pytest.mark.parametrize("method", ["generate", "stream"])
def test_an_unknown_keyword_or_both_forms_is_a_type_error_naming_them(llm: LLM, method: str) -> None:
    call = getattr(llm, method)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) max_length; .*max_new_tokens"):
        call("hi", max_length=5)
    with pytest.raises(TypeError, match=r"both params and the keyword argument\(s\) temperature"):
        call("hi", SamplingParams(), temperature=0.5)


def test_chat_names_its_options_when_a_keyword_is_unknown(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"max_length; .*max_new_tokens.*chat options: .*tool_choice"):
        llm.chat(USER, max_length=5)
    with pytest.raises(TypeError, match="both params"):
        llm.stream_chat(USER, SamplingParams(), seed=1)
