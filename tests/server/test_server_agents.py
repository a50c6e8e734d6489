"""What agents use, through the official ``openai`` client against live servers: tool calls, reasoning,
logprobs, ``/v1/responses``, ``/tokenize``, vLLM-named metrics.

Two tiny random models, each biased towards one tag so that a server process writes it on its own:

- ``tools``: a Hermes (Qwen3) template, ``<tool_call>`` favoured, so ``auto`` replies make calls;
- ``think``: a Qwen3.5-style template (the prompt opens ``<think>``), ``</think>`` favoured, so replies
  think for a few tokens and then answer.

Sampled replies are compared with ``LLM.chat`` on the same model with the same seed (the server's rows
decode to the same tokens as the library on fp32 exports).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_helpers import ServerProcess

import onnxgen
from onnxgen import LLM, SamplingParams
from onnxgen.generation.logprobs import log_softmax
from onnxgen.testing import TinySpec, bias_logits, build_model
from onnxgen.testing.chat_templates import HERMES_TEMPLATE, XML_TEMPLATE, install_chat_template

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "noop",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}
BIASED = {"tools": (HERMES_TEMPLATE, "<tool_call>"), "think": (XML_TEMPLATE, "</think>")}
TAG_BIAS = 6.0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("agent-models")
    out = {}
    for name, (template, tag) in BIASED.items():
        path = build_model(root / name, "genai-dense", TinySpec(vocab_size=1024, max_position=1024))
        install_chat_template(path, template)
        token = onnxgen.load(path, threads=1).tokenizer.token_to_id(tag)  # type: ignore[union-attr]
        out[name] = bias_logits(path, {token: TAG_BIAS})
    return out


@pytest.fixture(scope="module")
def servers(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("agent-servers")
    procs: dict[str, ServerProcess] = {}
    try:
        for name, path in models.items():
            procs[name] = ServerProcess(
                path, logs / f"{name}.log", "--max-batch", "4", "--max-model-len", "1024"
            )
        yield procs
    finally:
        for proc in procs.values():
            proc.close()


@pytest.fixture(scope="module")
def llms(models: dict[str, Path]) -> dict[str, LLM]:
    return {name: onnxgen.load(path, threads=1) for name, path in models.items()}


def sampled(seed: int, n: int = 60, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, **kw)


def chat(server: ServerProcess, seed: int, n: int = 60, **kw: Any) -> Any:
    return server.client.chat.completions.create(
        model=server.model_name,
        messages=kw.pop("messages", MESSAGES),
        max_tokens=n,
        temperature=1.0,
        seed=seed,
        **kw,
    )


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


# -- tool calls ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_schema_valid_and_the_one_llm_chat_makes(
    servers: dict[str, ServerProcess], llms: dict[str, LLM], choice: str
) -> None:
    tool_choice = "required" if choice == "required" else NAMED
    for seed in range(3):
        r = chat(
            servers["tools"],
            seed,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", message
        assert message.content is None and message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        alone = llms["tools"].chat(
            MESSAGES,
            sampled(seed),
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            chat_template_kwargs=NO_THINKING,
        )
        assert (call.function.name, call.function.arguments) == (
            alone.tool_calls[0].name,
            alone.tool_calls[0].arguments,
        )


def _streamed_calls(chunks: list[Any]) -> tuple[list[Any], list[str | None]]:
    parts = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return parts, reasons


def test_a_streamed_call_arrives_whole_once_complete_in_openai_s_delta_form(
    servers: dict[str, ServerProcess],
) -> None:
    """Each call is sent once its end tag arrives (so a call cut by max_tokens is never half sent):
    its first delta has the index, id, type and name, the arguments follow, all before the finish."""
    kw: dict[str, Any] = dict(
        tools=TOOLS, tool_choice=NAMED, extra_body={"chat_template_kwargs": NO_THINKING}
    )
    whole = chat(servers["tools"], 4, **kw).choices[0].message.tool_calls
    chunks = list(chat(servers["tools"], 4, stream=True, **kw))
    parts, reasons = _streamed_calls(chunks)
    first, rest = parts[0], parts[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in rest)
    arguments = (first.function.arguments or "") + "".join(p.function.arguments for p in rest)
    assert arguments == whole[0].function.arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])


def test_under_auto_the_calls_the_model_starts_are_valid_and_none_parses_no_calls(
    servers: dict[str, ServerProcess],
) -> None:
    calls = 0
    for seed in range(4):
        r = chat(servers["tools"], seed, 80, tools=TOOLS, extra_body={"chat_template_kwargs": NO_THINKING})
        choice = r.choices[0]
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            calls += 1
        if choice.finish_reason == "stop":
            assert choice.message.tool_calls is None
    assert calls > 0
    # negative control: with tool_choice none the same replies are not parsed into calls
    for seed in range(4):
        r = chat(
            servers["tools"],
            seed,
            80,
            tools=TOOLS,
            tool_choice="none",
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"


def test_a_call_cut_short_by_max_tokens_is_dropped_not_an_error(
    servers: dict[str, ServerProcess],
) -> None:
    r = chat(
        servers["tools"],
        0,
        6,
        tools=TOOLS,
        tool_choice="required",
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and choice.message.content == ""  # no fragment either


def test_a_tool_result_round_trip_renders_the_call_and_its_result_into_the_prompt(
    servers: dict[str, ServerProcess], llms: dict[str, LLM]
) -> None:
    server = servers["tools"]
    first = chat(
        server,
        1,
        tools=TOOLS,
        tool_choice=NAMED,
        parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    second = chat(
        server, 2, 12, messages=messages, tools=TOOLS, extra_body={"chat_template_kwargs": NO_THINKING}
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    alone = llms["tools"].chat(messages, sampled(2, 12), tools=TOOLS, chat_template_kwargs=NO_THINKING)
    assert second.usage.prompt_tokens == len(
        llms["tools"].tokenizer.encode(  # type: ignore[union-attr]
            llms["tools"].plan_chat(messages, tools=TOOLS, chat_template_kwargs=NO_THINKING).prompt,
            add_special_tokens=False,
        )
    )
    assert (second.choices[0].message.content or "") == alone.content
    shown = server.http.post(
        "/tokenize", json={"messages": messages, "tools": TOOLS, "chat_template_kwargs": NO_THINKING}
    ).json()
    text = server.http.post("/detokenize", json={"tokens": shown["tokens"]}).json()["prompt"]
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    assert json.dumps(json.loads(call.function.arguments)) in text  # the call, as the template writes it


# -- reasoning -----------------------------------------------------------------------------------------
def test_reasoning_is_split_from_the_answer_as_llm_chat_splits_it_streamed_and_not(
    servers: dict[str, ServerProcess], llms: dict[str, LLM]
) -> None:
    split_replies = 0
    for seed in range(6):
        alone = llms["think"].chat(MESSAGES, sampled(seed, 40))
        if not (alone.reasoning and alone.content):
            continue  # the bias did not close the thinking within 40 tokens
        split_replies += 1
        message = chat(servers["think"], seed, 40).choices[0].message
        assert extra(message, "reasoning_content") == extra(message, "reasoning") == alone.reasoning
        assert message.content == alone.content
        chunks = [c for c in chat(servers["think"], seed, 40, stream=True) if c.choices]
        reasoning = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert (reasoning, content) == (alone.reasoning, alone.content)
        split = next(i for i, c in enumerate(chunks) if c.choices[0].delta.content)
        assert all(extra(c.choices[0].delta, "reasoning_content") is None for c in chunks[split + 1 :])
    assert split_replies >= 2


def test_thinking_turned_off_by_template_kwargs_or_effort_gives_no_reasoning(
    servers: dict[str, ServerProcess],
) -> None:
    default = chat(servers["think"], 0, 8)
    off = chat(servers["think"], 0, 8, extra_body={"chat_template_kwargs": NO_THINKING})
    effort = chat(servers["think"], 0, 8, reasoning_effort="none")
    assert extra(off.choices[0].message, "reasoning_content") is None
    assert off.usage.prompt_tokens == effort.usage.prompt_tokens != default.usage.prompt_tokens
    assert off.choices[0].message.content == effort.choices[0].message.content


def test_a_json_schema_constrains_the_answer_after_free_reasoning(servers: dict[str, ServerProcess]) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(2):
        r = chat(servers["think"], seed, 120, response_format=fmt)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert extra(message, "reasoning_content")
        jsonschema.validate(json.loads(message.content), schema)


# -- logprobs ------------------------------------------------------------------------------------------
def _model_logprobs(llm: LLM, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Log-softmax of the model's logits at each generated position, from one forward over it all."""
    ids = np.asarray([prompt + tokens], dtype=np.int64)
    state = llm.session.new_state(ids.shape[1] + 1)
    logits = np.asarray(llm.session.forward(state, ids, None))[0]
    return np.stack([log_softmax(logits[len(prompt) - 1 + i]) for i in range(len(tokens))])


def test_chat_logprobs_are_the_models_log_softmax_for_the_chosen_tokens_streamed_and_not(
    servers: dict[str, ServerProcess], llms: dict[str, LLM]
) -> None:
    server, llm = servers["tools"], llms["tools"]
    kw: dict[str, Any] = dict(
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "chat_template_kwargs": NO_THINKING},
    )
    r = chat(server, 3, 10, **kw)
    tokens = extra(r.choices[0], "token_ids")
    prompt = llm.tokenizer.encode(
        llm.plan_chat(MESSAGES, chat_template_kwargs=NO_THINKING).prompt, add_special_tokens=False
    )  # type: ignore[union-attr]
    expected = _model_logprobs(llm, prompt, tokens)
    content = r.choices[0].logprobs.content
    assert len(content) == len(tokens) == 10
    for i, (entry, token) in enumerate(zip(content, tokens, strict=True)):
        assert entry.logprob == pytest.approx(expected[i, token], abs=1e-4)
        assert bytes(entry.bytes) == llm.token_bytes(token)
        best = np.argsort(-expected[i], kind="stable")[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(expected[i, best]), abs=1e-4)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [llm.token_bytes(int(t)) for t in best]
    streamed = [
        e
        for c in chat(server, 3, 10, stream=True, **kw)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_follow_the_legacy_shape(
    servers: dict[str, ServerProcess], llms: dict[str, LLM]
) -> None:
    server, llm = servers["tools"], llms["tools"]
    r = server.client.completions.create(
        model=server.model_name,
        prompt="the quick brown fox",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens = extra(r.choices[0], "token_ids")
    expected = _model_logprobs(llm, llm.encode("the quick brown fox"), tokens)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([expected[i, t] for i, t in enumerate(tokens)], abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens).startswith(r.choices[0].text[:1])


# -- /v1/responses ---------------------------------------------------------------------------------------
def test_a_response_answers_what_the_same_chat_answers_and_streams_the_same_text(
    servers: dict[str, ServerProcess],
) -> None:
    server = servers["tools"]
    r = server.client.responses.create(
        model=server.model_name,
        instructions="Be brief.",
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0,
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    same = server.client.chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=12, temperature=0
    )
    assert r.status in ("completed", "incomplete") and r.output_text == same.choices[0].message.content
    assert (
        r.usage.input_tokens == same.usage.prompt_tokens
        and r.usage.output_tokens == same.usage.completion_tokens
    )
    events = list(
        server.client.responses.create(
            model=server.model_name,
            instructions="Be brief.",
            input="Name a colour.",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if r.status == "completed" else "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def two_turns(server: ServerProcess) -> tuple[Any, Any]:
    """A greedy response and its continuation through ``previous_response_id``."""
    first = server.client.responses.create(
        model=server.model_name, input="Name a colour.", max_output_tokens=5, temperature=0
    )
    second = server.client.responses.create(
        model=server.model_name,
        input="And another?",
        previous_response_id=first.id,
        max_output_tokens=5,
        temperature=0,
    )
    return first, second


def test_previous_response_id_continues_the_stored_conversation(servers: dict[str, ServerProcess]) -> None:
    server = servers["tools"]
    first, second = two_turns(server)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"},
    ]
    same = server.client.chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=5, temperature=0
    )
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.output_text == same.choices[0].message.content
    assert server.client.responses.retrieve(second.id).output_text == second.output_text
    missing = server.http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"


def test_a_response_with_tools_and_reasoning_has_its_items(servers: dict[str, ServerProcess]) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = servers["tools"].client.responses.create(
        model=servers["tools"].model_name,
        input="Weather?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        reasoning={"effort": "none"},
        max_output_tokens=60,
        temperature=1.0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # An unseeded sample (the Responses API takes no seed): the favoured ``</think>`` may close the thinking
    # at its first token, leaving nothing to show as reasoning, so a few replies are drawn.
    for _ in range(8):
        think = servers["think"].client.responses.create(
            model=servers["think"].model_name,
            input="Hi",
            max_output_tokens=40,
            temperature=1.0,
            top_p=1.0,
        )
        reasoning = think.output[0]
        if reasoning.type == "reasoning":
            break
        assert reasoning.type == "message"
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.content[0].text
    assert think.usage.output_tokens_details.reasoning_tokens > 0


# -- utilities -----------------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip_in_vllm_shapes(
    servers: dict[str, ServerProcess], llms: dict[str, LLM]
) -> None:
    server, llm = servers["tools"], llms["tools"]
    text = "the quick brown fox"
    t = server.http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert t["tokens"] == llm.encode(text) and t["count"] == len(t["tokens"]) and t["max_model_len"] == 1024
    assert len(t["token_strs"]) == t["count"]
    assert server.http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": text}
    chat_count = server.http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert chat_count == chat(server, 0, 1).usage.prompt_tokens
    bad = server.http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert server.http.post("/tokenize", json={}).status_code == 400
    card = server.client.models.list().data[0]
    assert extra(card, "max_model_len") == 1024


def test_stop_token_ids_end_a_reply_on_that_token(servers: dict[str, ServerProcess]) -> None:
    server = servers["tools"]
    body = {
        "prompt": "the quick brown fox",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    free = server.http.post("/v1/completions", json=body).json()["choices"][0]
    stop = free["token_ids"][3]
    cut = server.http.post("/v1/completions", json={**body, "stop_token_ids": [stop]}).json()["choices"][0]
    assert cut["token_ids"] == free["token_ids"][: free["token_ids"].index(stop) + 1]
    assert cut["finish_reason"] == "stop"


def test_streamed_usage_is_sent_once_on_a_final_chunk(servers: dict[str, ServerProcess]) -> None:
    chunks = list(chat(servers["tools"], 0, 6, stream=True, stream_options={"include_usage": True}))
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    assert not [c for c in chat(servers["tools"], 0, 6, stream=True) if c.usage is not None]


VLLM_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_success_total",
)


def test_metrics_carry_the_vllm_names_and_count_the_traffic(servers: dict[str, ServerProcess]) -> None:
    server = servers["tools"]

    def by_name() -> dict[str, float]:
        out: dict[str, float] = {}
        for (name, labels), value in server.metrics().items():
            if name.startswith("vllm:"):
                assert ("model_name", server.model_name) in labels, (name, labels)
                out[name] = out.get(name, 0.0) + value
        return out

    before = by_name()
    r = chat(server, 0, 5, extra_body={"ignore_eos": True})
    after = by_name()
    assert set(VLLM_METRICS) <= set(after)
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 5
    assert (
        after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == r.usage.prompt_tokens
    )
    assert (
        after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"]
        == 1
    )
    assert (
        after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"]
        == 4
    )
    assert after["vllm:num_requests_running"] == after["vllm:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].parameters must be a JSON schema object",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                    }
                ]
            },
            "not valid JSON",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_problem_and_the_server_goes_on(
    servers: dict[str, ServerProcess], body: dict[str, Any], says: str
) -> None:
    server = servers["tools"]
    r = server.http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert chat(server, 0, 2).choices[0].finish_reason == "length"


def test_a_continued_response_resumes_its_conversation_from_the_prefix_cache(
    models: dict[str, Path], servers: dict[str, ServerProcess], tmp_path: Path
) -> None:
    """With ``--prefix-cache-mb`` the turn after ``previous_response_id`` prefills only what is new: its
    usage reports the first turn's tokens as cached, and the answers equal a server without the cache."""
    cached_server = ServerProcess(
        models["tools"], tmp_path / "cached.log", "--prefix-cache-mb", "16", "--max-model-len", "1024"
    )
    try:
        first, second = two_turns(cached_server)
        plain_first, plain_second = two_turns(servers["tools"])
    finally:
        cached_server.close()
    assert (first.output_text, second.output_text) == (plain_first.output_text, plain_second.output_text)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert plain_second.usage.input_tokens_details.cached_tokens == 0  # no cache: all prefilled
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens - 1 <= cached < second.usage.input_tokens, cached
