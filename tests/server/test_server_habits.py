"""The server as OpenAI and vLLM clients expect it, in process: ``client.models.retrieve``, ``/v1/tokenize``,
``x-api-key``, ``--metrics-open``, hermes as the tool-call parser where the template names none, an empty
reply as ``""``, a tool call cut by ``max_tokens``, ``logit_bias`` and closed objects in schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from onnxgen import LLM, load
from onnxgen.cli import build_parser
from onnxgen.server.app import create_app
from onnxgen.server.scheduler import SchedulerConfig
from onnxgen.server.security import SecurityConfig
from onnxgen.serving.engine import EngineSpec, load_app
from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.chat_templates import HERMES_TEMPLATE, install_chat_template

KEY = "s3cret-key"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
COMMA = 14  # the tiny tokenizer's ","


@pytest.fixture(scope="module")
def llm(server_models: dict[str, Path]) -> LLM:
    return load(server_models["genai-dense"], threads=1)  # its template shows no tool-call format


@pytest.fixture(scope="module")
def hermes_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    spec = TinySpec(vocab_size=1024, max_position=1024)
    path = build_model(tmp_path_factory.mktemp("hermes"), "genai-dense", spec)
    install_chat_template(path, HERMES_TEMPLATE)
    return load(path, threads=1)


@contextmanager
def client(llm: LLM, security: SecurityConfig | None = None, **options: Any) -> Iterator[TestClient]:
    limit = min(llm.package.context_length or 256, 1024)
    config = SchedulerConfig(max_batch=2, max_queue=2, max_model_len=limit)
    app = create_app(llm, config, security=security, **options)
    with TestClient(app, base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as c:
        yield c


def openai_client(http: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=key, http_client=http, max_retries=0)


def served(c: TestClient) -> str:
    return str(c.get("/v1/models").json()["data"][0]["id"])


def test_models_retrieve_answers_the_served_model_and_404s_another(llm: LLM) -> None:
    with client(llm) as c:
        api = openai_client(c)
        name = api.models.list().data[0].id
        model = api.models.retrieve(name)  # GET /v1/models/{id}
        assert model.id == name and model.object == "model"
        assert c.get(f"/v1/models/{name}").json() == c.get("/v1/models").json()["data"][0]
        with pytest.raises(openai.NotFoundError, match="not served here"):
            api.models.retrieve("other-model")


def test_tokenize_and_detokenize_answer_under_v1_as_at_the_root(llm: LLM) -> None:
    with client(llm) as c:
        body = {"prompt": "hello there"}
        root = c.post("/tokenize", json=body)
        assert root.status_code == 200 and root.json()["tokens"] == llm.encode("hello there")
        assert c.post("/v1/tokenize", json=body).json() == root.json()
        ids = {"tokens": root.json()["tokens"]}
        assert c.post("/v1/detokenize", json=ids).json() == c.post("/detokenize", json=ids).json()


def test_x_api_key_is_accepted_beside_the_bearer_header(llm: LLM) -> None:
    with client(llm, SecurityConfig(api_key=KEY)) as c:
        assert c.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": f" {KEY} "}).status_code == 200
        for wrong in ("nope", KEY + "x", ""):
            assert c.get("/v1/models", headers={"x-api-key": wrong}).status_code == 401
        # a wrong bearer with the right x-api-key: one right key is enough
        both = {"authorization": "Bearer nope", "x-api-key": KEY}
        assert c.get("/v1/models", headers=both).status_code == 200
        assert openai_client(c, KEY).models.list().data  # the openai client's bearer still works


def test_metrics_open_answers_metrics_without_the_key_and_nothing_else(llm: LLM) -> None:
    assert build_parser().parse_args(["serve", "m", "--metrics-open"]).metrics_open is True
    with client(llm, SecurityConfig(api_key=KEY, metrics_open=True)) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 401
    with client(llm, SecurityConfig(api_key=KEY)) as c:  # control: without the flag it needs the key
        assert c.get("/metrics").status_code == 401


def test_a_template_without_a_tool_call_format_gets_hermes_said_in_models_and_at_start(
    llm: LLM, server_models: dict[str, Path]
) -> None:
    with client(llm) as c:
        card = c.get("/v1/models").json()["data"][0]
        assert card["tool_call_parser"] == "hermes" and "default" in card["tool_call_parser_source"]
        body = {"messages": USER, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 100, "temperature": 0}
        r = c.post("/v1/chat/completions", json=body)  # was a 400 naming a setting that did not exist
        assert r.status_code == 200, r.text
        [call] = r.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])
    with client(llm, tool_parser="qwen3_coder") as c:  # the flag wins and is named
        card = c.get("/v1/models").json()["data"][0]
        assert (card["tool_call_parser"], card["tool_call_parser_source"]) == (
            "qwen3_coder",
            "--tool-call-parser",
        )
    said: list[str] = []
    load_app(EngineSpec(str(server_models["genai-dense"]), threads=1, min_rows=1), said.append)
    assert any(line.startswith("tool calls are read as hermes (the default") for line in said), said


def test_an_empty_reply_is_an_empty_string_not_null(llm: LLM) -> None:
    eos = llm.eos_token_ids[0]
    body = {"messages": USER, "max_tokens": 5, "logit_bias": {str(eos): 100}}  # eos first: nothing said
    with client(llm) as c:
        reply = openai_client(c).chat.completions.create(model=served(c), **body)  # type: ignore[call-overload]
        choice = reply.choices[0]
        assert choice.message.content == "" and choice.finish_reason == "stop"
        assert choice.message.tool_calls is None


def _streamed(c: TestClient, body: dict[str, Any]) -> tuple[str, list[Any], list[Any]]:
    content, calls, reasons = "", [], []
    for chunk in openai_client(c).chat.completions.create(model=served(c), stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_a_tool_call_cut_by_max_tokens_is_reported_alike_streamed_and_not(hermes_llm: LLM) -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 4, "temperature": 0}
    body["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    with client(hermes_llm) as c:
        api = openai_client(c)
        whole = api.chat.completions.create(model=served(c), **body).choices[0]
        assert whole.finish_reason == "length"
        assert whole.message.tool_calls is None and whole.message.content == ""  # no fragment as content
        content, calls, reasons = _streamed(c, body)
        assert (content, calls, reasons[-1]) == ("", [], "length")  # no half call with invalid JSON
        # control: given room, the same request makes a whole, valid call, streamed and not
        roomy = {**body, "max_tokens": 80}
        done = api.chat.completions.create(model=served(c), **roomy).choices[0]
        assert done.finish_reason == "tool_calls"
        arguments = done.message.tool_calls[0].function.arguments  # type: ignore[index]
        content, calls, reasons = _streamed(c, roomy)
        assert "".join(p.function.arguments or "" for p in calls) == arguments and json.loads(arguments)


def test_logit_bias_forces_and_bans_tokens_in_a_completion(llm: LLM) -> None:
    body = {"prompt": "the quick brown fox", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    body["return_token_ids"] = True
    with client(llm) as c:
        plain = c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        forced = c.post("/v1/completions", json={**body, "logit_bias": {"7": 100}}).json()
        assert forced["choices"][0]["token_ids"] == [7] * 4 != plain
        banned = c.post("/v1/completions", json={**body, "logit_bias": {str(plain[0]): -100}}).json()
        assert banned["choices"][0]["token_ids"][0] != plain[0]
    assert plain == llm.generate("the quick brown fox", max_new_tokens=4, ignore_eos=True).token_ids


def test_a_schema_that_says_nothing_of_extra_keys_gets_only_its_keys_unless_asked(llm: LLM) -> None:
    """What Pydantic, instructor and LangChain send. A "," favoured tempts the model to add keys: under
    OpenAI's reading it cannot, and the reply ends; under JSON Schema's it adds keys to the token limit."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
    body = {
        "messages": USER,
        "max_tokens": 40,
        "temperature": 0,
        "logit_bias": {str(COMMA): 10},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    with client(llm) as c:
        closed = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert closed["finish_reason"] == "stop" and set(json.loads(closed["message"]["content"])) <= {"a"}
        body["json_extra_properties"] = True
        permissive = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert permissive["finish_reason"] == "length"  # the control: keys went on being added
