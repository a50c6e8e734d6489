"""The OpenAI API of ``onnxgen serve`` through the official ``openai`` client, against a real server process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import ServerProcess

from onnxgen import LLM, SamplingParams, load

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(
    server_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server-api") / "server.log"
    proc = ServerProcess(server_models["genai-dense"], log, "--max-batch", "4", "--max-queue", "4")
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def llm(server_models: dict[str, Path]) -> LLM:
    return load(server_models["genai-dense"], threads=1)


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def token_ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


# -- completions and chat --------------------------------------------------------------------------------
def test_health_and_models_list_the_served_model(server: ServerProcess) -> None:
    assert server.http.get("/health").json() == {"status": "ok"}
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["genai-dense"]


def test_a_greedy_completion_returns_what_llm_generate_returns_with_usage(
    server: ServerProcess, llm: LLM
) -> None:
    alone = llm.generate(PROMPT, greedy(max_new_tokens=12, ignore_eos=True))
    r = server.client.completions.create(
        model="genai-dense",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert r.object == "text_completion" and len(r.choices) == 1
    assert token_ids(r.choices[0]) == alone.token_ids
    assert r.choices[0].text == alone.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(llm.encode(PROMPT)), 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_a_request_without_model_is_served_by_the_one_model(server: ServerProcess, llm: LLM) -> None:
    """One model is served, so ``model`` may be left out (as vLLM and llama.cpp's server allow)."""
    alone = llm.generate(PROMPT, greedy(max_new_tokens=6, ignore_eos=True))
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "genai-dense"
    assert r.json()["choices"][0]["text"] == alone.text
    chat = {"messages": MESSAGES, "max_tokens": 2}
    assert server.http.post("/v1/chat/completions", json=chat).status_code == 200


def test_a_completion_of_token_ids_equals_the_completion_of_their_text(
    server: ServerProcess, llm: LLM
) -> None:
    ids = llm.encode(PROMPT)
    by_text = server.client.completions.create(
        model="genai-dense", prompt=PROMPT, max_tokens=8, temperature=0
    )
    by_ids = server.client.completions.create(model="genai-dense", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_a_greedy_chat_completion_returns_what_llm_chat_returns(server: ServerProcess, llm: LLM) -> None:
    alone = llm.chat(MESSAGES, greedy(max_new_tokens=10, ignore_eos=True))
    r = server.client.chat.completions.create(
        model="genai-dense", messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == alone.text
    assert r.usage is not None and r.usage.prompt_tokens == len(llm.chat_prompt(MESSAGES))


def test_a_streamed_completion_adds_up_to_the_whole_text_and_ends_with_finish_reason_and_usage(
    server: ServerProcess, llm: LLM
) -> None:
    alone = llm.generate(PROMPT, greedy(max_new_tokens=16, ignore_eos=True))
    chunks = list(
        server.client.completions.create(
            model="genai-dense",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *choice_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in choice_chunks) == alone.text
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 16
    assert all(c.usage is None for c in choice_chunks)  # usage is sent once, as OpenAI sends it


def test_a_streamed_chat_starts_with_the_assistant_role_and_adds_up_to_the_chat_text(
    server: ServerProcess, llm: LLM
) -> None:
    alone = llm.chat(MESSAGES, greedy(max_new_tokens=10, ignore_eos=True))
    chunks = list(
        server.client.chat.completions.create(
            model="genai-dense",
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone.text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].usage is None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.usage is not None for c in chunks].count(True) == 1


# -- sampling parameters ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.5},
        {"repetition_penalty": 1.8},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.8, "top_p": 0.6, "seed": 11},
        {"temperature": 1.0, "top_k": 5, "min_p": 0.05, "seed": 3},
    ],
    ids=["presence", "frequency", "repetition", "seeded", "top_p", "top_k_min_p"],
)
def test_sampling_parameters_give_what_llm_generate_gives_with_the_same_parameters(
    server: ServerProcess, llm: LLM, fields: dict[str, Any]
) -> None:
    params = {"temperature": 0.0, **fields}
    alone = llm.generate(PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True, **params))
    plain = llm.generate(PROMPT, greedy(max_new_tokens=20, ignore_eos=True))
    assert alone.token_ids != plain.token_ids  # the parameter changes the output, so the test can tell
    extra = {k: v for k, v in params.items() if k in ("top_k", "min_p", "repetition_penalty")}
    std = {k: v for k, v in params.items() if k not in extra}
    r = server.client.completions.create(
        model="genai-dense",
        prompt=PROMPT,
        max_tokens=20,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        **std,
    )
    assert token_ids(r.choices[0]) == alone.token_ids


@pytest.fixture(scope="module")
def eos_prompt(llm: LLM) -> tuple[str, int]:
    """A prompt whose greedy continuation ends with an eos token, and how many tokens that takes."""
    for k in range(100):
        prompt = f"the {k} quick"
        result = llm.generate(prompt, greedy(max_new_tokens=40))
        if result.finish_reason == "stop":
            return prompt, len(result.token_ids)
    raise AssertionError("no candidate prompt of the tiny model reaches eos within 40 tokens")


def test_eos_stops_min_tokens_holds_it_back_and_ignore_eos_runs_to_max_tokens(
    server: ServerProcess, llm: LLM, eos_prompt: tuple[str, int]
) -> None:
    prompt, length = eos_prompt

    def complete(**extra: Any) -> Any:
        return server.client.completions.create(
            model="genai-dense", prompt=prompt, max_tokens=40, temperature=0, extra_body=extra
        ).choices[0]

    stopped = complete(return_token_ids=True)
    assert stopped.finish_reason == "stop" and len(token_ids(stopped)) == length
    held = complete(min_tokens=length + 5, return_token_ids=True)
    assert len(token_ids(held)) >= length + 5
    assert (
        token_ids(held)
        == llm.generate(prompt, greedy(max_new_tokens=40, min_new_tokens=length + 5)).token_ids
    )
    ignored = complete(ignore_eos=True, return_token_ids=True)
    assert ignored.finish_reason == "length" and len(token_ids(ignored)) == 40


def test_a_stop_string_ends_the_text_before_it_on_both_endpoints(server: ServerProcess, llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(max_new_tokens=30, ignore_eos=True)).text
    stop = full[10:12]
    expected = full[: full.find(stop)]
    r = server.client.completions.create(
        model="genai-dense",
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chat_full = llm.chat(MESSAGES, greedy(max_new_tokens=30, ignore_eos=True)).text
    chat_stop = chat_full[8:10]
    streamed = server.client.chat.completions.create(
        model="genai-dense",
        messages=MESSAGES,
        max_tokens=30,
        temperature=0,
        stop=chat_stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_full[: chat_full.find(chat_stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_are_all_returned_and_choice_i_samples_with_seed_plus_i(server: ServerProcess) -> None:
    def complete(n: int, seed: int) -> Any:
        return server.client.completions.create(
            model="genai-dense", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, n=n
        )

    r = complete(3, 5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1
    assert texts == [complete(1, 5 + i).choices[0].text for i in range(3)]
    assert r.usage is not None and r.usage.completion_tokens == 36
    greedy_n = server.client.chat.completions.create(
        model="genai-dense", messages=MESSAGES, max_tokens=8, temperature=0, n=2
    )
    assert len(greedy_n.choices) == 2
    assert greedy_n.choices[0].message.content == greedy_n.choices[1].message.content


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
}


def test_a_json_schema_response_format_constrains_the_output_like_llm_chat_does(
    server: ServerProcess, llm: LLM
) -> None:
    alone = llm.chat(MESSAGES, greedy(max_new_tokens=60, json_schema=SCHEMA))
    r = server.client.chat.completions.create(
        model="genai-dense",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    )
    content = r.choices[0].message.content
    assert content == alone.text
    assert r.choices[0].finish_reason == "stop"  # the object closed: nothing but eos may follow
    value = json.loads(content)
    assert isinstance(value["n"], int) and isinstance(value["ok"], bool)


def test_a_schema_that_does_not_compile_is_a_400_naming_it(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        server.client.chat.completions.create(
            model="genai-dense",
            messages=MESSAGES,
            max_tokens=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
