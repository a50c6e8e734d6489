"""onnxgen.load and LLM: every family loads and decodes greedily like a plain loop; chat templates; no tokenizer."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen import GenerationError, SamplingParams, TokenizerError
from onnxgen.llm import LLM
from onnxgen.model import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import FAMILIES, build_model, special_token_ids

PROMPT = "Hello, world"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm")
    return {family: build_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def hybrid(model_dirs: dict[str, Path]) -> LLM:
    return onnxgen.load(model_dirs["hybrid-genai"], threads=1)


def plain_greedy_loop(model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    package = ModelPackage.open(model_dir)
    session = DecoderSession(session_graph(package.model_path, package.io), threads=1)
    state = session.new_state(len(prompt) + steps)
    out = [int(np.argmax(session.forward(state, np.asarray([prompt]))[0, -1]))]
    while len(out) < steps:
        out.append(int(np.argmax(session.forward(state, np.asarray([[out[-1]]]))[0, -1])))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_and_decodes_greedily_like_a_plain_loop_over_the_session(
    model_dirs: dict[str, Path], family: str
) -> None:
    llm = onnxgen.load(model_dirs[family], threads=1)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    result = llm.generate(PROMPT, params)
    assert result.token_ids == plain_greedy_loop(model_dirs[family], llm.encode(PROMPT), 16)
    assert llm.generate(PROMPT, params).token_ids == result.token_ids
    assert llm.io.is_hybrid == family.startswith("hybrid")


def test_detokenize_false_streams_the_same_token_ids_without_text_or_detokenizing(
    hybrid: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with_text = list(hybrid.stream(PROMPT, params))
    assert "".join(e.text for e in with_text)  # the tiny tokenizer decodes these ids to some text

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("detokenize=False must not build a detokenizer")

    monkeypatch.setattr("onnxgen.engine.sequence.IncrementalDetokenizer", refuse)
    ids_only = list(hybrid.stream(PROMPT, dataclasses.replace(params, detokenize=False)))
    assert [e.token_ids for e in ids_only] == [e.token_ids for e in with_text]
    assert all(e.text == "" for e in ids_only)
    assert ids_only[-1].finish_reason == with_text[-1].finish_reason == "length"
    result = hybrid.generate(PROMPT, dataclasses.replace(params, detokenize=False))
    assert result.text == "" and result.token_ids == [t for e in with_text for t in e.token_ids]
    (batched,) = hybrid.generate([PROMPT], dataclasses.replace(params, detokenize=False))  # the engine too
    assert batched.text == "" and batched.token_ids == result.token_ids


def test_chat_renders_the_chat_template_around_the_messages(
    hybrid: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[int]] = []
    generate = hybrid.generator.generate

    def spy(prompt_ids: list[int], *args: Any, **kw: Any) -> Any:
        seen.append(list(prompt_ids))
        return generate(prompt_ids, *args, **kw)

    monkeypatch.setattr(hybrid.generator, "generate", spy)
    result = hybrid.chat(MESSAGES, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(seen) == 1 and len(result.token_ids) == 6
    text = hybrid.tokenizer.decode(seen[0], skip_special_tokens=False)  # type: ignore[union-attr]
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    )
    specials = special_token_ids(hybrid.session.vocab_size)
    assert seen[0].count(specials["<|im_start|>"]) == 3  # markers are single special tokens, not text


def test_chat_and_stream_chat_give_what_generate_gives_on_the_templated_prompt(hybrid: LLM) -> None:
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    chat = hybrid.chat(MESSAGES, params)
    assert chat.token_ids == hybrid.generate(hybrid.chat_prompt(MESSAGES), params).token_ids
    events = list(hybrid.stream_chat(MESSAGES, params))
    assert [e.token_ids[0] for e in events] == chat.token_ids
    assert "".join(e.text for e in events) == chat.text


def test_a_model_without_a_tokenizer_takes_token_ids_and_refuses_text(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model_dirs["genai-dense"], bare)
    (bare / "tokenizer.json").unlink()
    (bare / "tokenizer_config.json").unlink()
    llm = onnxgen.load(bare, threads=1)
    assert llm.tokenizer is None
    assert len(llm.eos_token_ids) == 2  # from genai_config / generation_config
    result = llm.generate([5, 17, 200], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(result.token_ids) == 4 and result.text == ""
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        llm.generate("text")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        llm.chat(MESSAGES)
    with pytest.raises(GenerationError, match=r"stop strings \['END'\].*no tokenizer"):
        llm.generate([5, 17, 200], SamplingParams(max_new_tokens=4, stop="END"))


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda llm: llm.generate(b"def f():", max_new_tokens=2), "prompt is bytes"),
        (lambda llm: llm.generate([b"def f():"], max_new_tokens=2), "prompt is bytes"),
        (lambda llm: llm.generate("ab\ud800c", max_new_tokens=2), "lone UTF-16 surrogate"),
        (lambda llm: llm.chat([{"role": "user", "content": "a\udfff"}], max_new_tokens=2), "surrogate"),
        (lambda llm: llm.chat([], max_new_tokens=2), "messages is empty"),
        (lambda llm: llm.chat([{"role": "root", "content": "hi"}], max_new_tokens=2), "'root'"),
        (lambda llm: list(llm.stream_chat([{"content": "hi"}], max_new_tokens=2)), "role must be one of"),
        (lambda llm: llm.chat_prompt([{"role": "robot", "content": "hi"}]), "role must be one of"),
    ],
)
def test_library_input_the_server_refuses_is_an_onnxgen_error_naming_the_fix(
    hybrid: LLM, call: Any, says: str
) -> None:
    with pytest.raises(onnxgen.OnnxgenError, match=says):
        call(hybrid)
