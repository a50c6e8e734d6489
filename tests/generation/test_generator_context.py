"""The context length bounds prompts and max_new_tokens (a model whose context holds 32 tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

import onnxgen
from onnxgen import GenerationError, SamplingParams
from onnxgen.llm import LLM
from onnxgen.testing import TinySpec, build_model

CONTEXT = 32


@pytest.fixture(scope="module", params=["hybrid-genai", "standard-dense"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    family = request.param
    spec = (
        TinySpec.hybrid(max_position=CONTEXT)
        if family.startswith("hybrid")
        else TinySpec(max_position=CONTEXT)
    )
    path: Path = build_model(tmp_path_factory.mktemp("context") / family, family, spec)
    return onnxgen.load(path, threads=1)


def ids(n: int) -> list[int]:
    return [(7 * i + 3) % 250 + 5 for i in range(n)]


def test_the_context_length_comes_from_the_model_configs(llm: LLM) -> None:
    assert llm.generator.context_length == CONTEXT


@pytest.mark.parametrize("prompt_len", [CONTEXT, CONTEXT + 9])
def test_a_prompt_that_fills_the_context_is_refused_naming_both_lengths(llm: LLM, prompt_len: int) -> None:
    with pytest.raises(GenerationError, match=rf"prompt has {prompt_len} tokens.*context holds {CONTEXT}"):
        llm.generate(ids(prompt_len), SamplingParams(max_new_tokens=4))
    with pytest.raises(GenerationError, match=rf"{prompt_len} tokens.*{CONTEXT}"):
        llm.stream(ids(prompt_len), SamplingParams(max_new_tokens=4))


def test_a_long_text_prompt_is_refused_rather_than_answered_empty(llm: LLM) -> None:
    text = "def generate(prompt, params):\n    return model(prompt)\n" * 4
    n = len(llm.encode(text))
    assert n > CONTEXT
    with pytest.raises(GenerationError, match=rf"{n} tokens.*{CONTEXT}"):
        llm.generate(text)


@pytest.mark.parametrize(("prompt_len", "room"), [(CONTEXT - 1, 1), (CONTEXT - 5, 5)])
def test_max_new_tokens_is_clipped_to_the_room_left_in_the_context(
    llm: LLM, prompt_len: int, room: int
) -> None:
    params = SamplingParams(max_new_tokens=20, min_new_tokens=10, ignore_eos=True)
    result = llm.generate(ids(prompt_len), params)
    assert result.finish_reason == "length"
    assert len(result.token_ids) == room
    assert result.stats["prompt_tokens"] + result.stats["generated_tokens"] == CONTEXT
    # The clipped run is the start of an unclipped one.
    full = llm.generate(ids(prompt_len), SamplingParams(max_new_tokens=room, ignore_eos=True))
    assert full.token_ids == result.token_ids


def test_a_monkeypatched_context_length_bounds_prompts_the_same_way(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm.generator, "context_length", 10)
    with pytest.raises(GenerationError, match=r"prompt has 12 tokens.*context holds 10"):
        llm.generate(ids(12))
    assert len(llm.generate(ids(8), SamplingParams(max_new_tokens=9, ignore_eos=True)).token_ids) == 2
