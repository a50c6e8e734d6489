"""The app in process: who may call it (API key, Host, Origin/CORS, docs), /metrics counting 5xx answers,
and errors found in the middle of decoding."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from onnxgen import LLM, PromptLookup, load
from onnxgen.errors import GenerationError
from onnxgen.server.app import create_app
from onnxgen.server.scheduler import SchedulerConfig
from onnxgen.server.security import SecurityConfig
from onnxgen.testing import build_model, poison_positions, poison_weights

KEY = "s3cret-key"
BODY = {"prompt": "hi", "max_tokens": 2}
CONFIG = SchedulerConfig(max_batch=2, max_queue=2, max_model_len=128)


@pytest.fixture(scope="module")
def llm(server_models: dict[str, Path]) -> LLM:
    return load(server_models["genai-dense"], threads=1)


@contextmanager
def client(llm: LLM, security: SecurityConfig, host: str = "127.0.0.1:8000") -> Iterator[TestClient]:
    app = create_app(llm, CONFIG, security=security)
    with TestClient(app, base_url=f"http://{host}", raise_server_exceptions=False) as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_an_api_key_guards_every_endpoint_but_health(llm: LLM) -> None:
    with client(llm, SecurityConfig(api_key=KEY)) as c:
        assert c.get("/health").status_code == 200
        for method, path in [
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/v1/completions"),
            ("GET", "/x"),
        ]:
            for headers in [{}, bearer("wrong"), bearer(KEY[:-1]), bearer(KEY + "x"), {"authorization": KEY}]:
                r = c.request(method, path, json=BODY, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers=bearer(KEY)).status_code == 200
        assert c.post("/v1/completions", json=BODY, headers=bearer(KEY)).status_code == 200
        assert (
            c.post("/v1/completions", json=BODY, headers={"authorization": f"bearer  {KEY} "}).status_code
            == 200
        )


def test_the_host_header_must_name_the_bound_address_loopback_or_an_allowed_host(llm: LLM) -> None:
    with client(llm, SecurityConfig(allowed_hosts=("api.example",))) as c:
        for host, status in [
            ("evil.example", 400),
            ("evil.example:8000", 400),
            ("127.0.0.1.evil.example", 400),
            ("127.0.0.1:8000", 200),
            ("localhost:8000", 200),
            ("[::1]:8000", 200),
            ("API.example:443", 200),
        ]:
            r = c.get("/v1/models", headers={"host": host})
            assert r.status_code == status, host
        assert (
            "--allowed-hosts" in c.get("/health", headers={"host": "evil.example"}).json()["error"]["message"]
        )
    with client(llm, SecurityConfig(host="0.0.0.0")) as c:  # reachable by any name: no check unless asked
        assert c.get("/v1/models", headers={"host": "anything.example"}).status_code == 200
    with client(llm, SecurityConfig(host="0.0.0.0", allowed_hosts=("api.example",))) as c:
        assert c.get("/v1/models", headers={"host": "anything.example"}).status_code == 400


def test_cross_origin_browser_requests_are_refused_unless_their_origin_is_allowed(llm: LLM) -> None:
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
    with client(llm, SecurityConfig()) as c:
        r = c.post("/v1/completions", json=BODY, headers={"origin": "https://app.example"})
        assert r.status_code == 403 and "--cors-origins" in r.json()["error"]["message"]
        assert c.options("/v1/completions", headers=preflight).status_code == 403
        # the server's own pages (same origin) may call it
        assert (
            c.post("/v1/completions", json=BODY, headers={"origin": "http://127.0.0.1:8000"}).status_code
            == 200
        )
    with client(llm, SecurityConfig(api_key=KEY, cors_origins=("https://app.example",))) as c:
        asked = {**preflight, "access-control-request-headers": "authorization,content-type"}
        r = c.options("/v1/completions", headers=asked)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/completions", json=BODY, headers={"origin": "https://app.example", **bearer(KEY)})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        other = {"origin": "https://evil.example", "access-control-request-method": "POST"}
        assert c.options("/v1/completions", headers=other).status_code == 400  # CORS refuses the preflight
        r = c.post("/v1/completions", json=BODY, headers={"origin": "https://evil.example", **bearer(KEY)})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_a_post_body_not_declared_json_is_refused_with_415(llm: LLM) -> None:
    with client(llm, SecurityConfig()) as c:
        for content_type in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]:
            headers = {"content-type": content_type} if content_type else {}
            r = c.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
            assert r.status_code == 415, content_type
        assert (
            c.post(
                "/v1/completions",
                content=b'{"prompt": "hi", "max_tokens": 1}',
                headers={"content-type": "Application/JSON; charset=utf-8"},
            ).status_code
            == 200
        )


def test_docs_and_the_openapi_schema_are_served_only_when_asked(llm: LLM) -> None:
    with client(llm, SecurityConfig()) as c:
        assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 404
    with client(llm, SecurityConfig(docs=True)) as c:
        assert (
            c.get("/docs").status_code == 200 and c.get("/openapi.json").json()["info"]["title"] == "onnxgen"
        )


def _count(c: TestClient, endpoint: str, status: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f'onnxgen_requests_total{{endpoint="{endpoint}",status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_5xx_answers_and_requests_refused_before_any_route(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    with client(llm, SecurityConfig()) as c:
        server = c.app.state.server  # type: ignore[attr-defined]

        def broken(body: bytes, chat: bool, api_key: int | None = None) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(server, "preparer", broken)
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 500 and "a bug" in r.json()["error"]["message"]
        c.post("/v1/completions", json=BODY, headers={"host": "evil.example"})
        c.post("/v1/completions", content=b"{}")
        assert _count(c, "completions", "500") == 1
        assert _count(c, "completions", "400") == 1 and _count(c, "completions", "415") == 1


def test_a_model_computing_nan_fails_each_request_with_a_500_naming_the_export(tmp_path: Path) -> None:
    model = poison_weights(build_model(tmp_path / "nan", "genai-dense"))
    with client(load(model, threads=1), SecurityConfig()) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 500 and str(model / "model.onnx") in r.json()["error"]["message"]
        assert _count(c, "completions", "500") == 1
        assert c.get("/health").status_code == 200


def test_logits_that_turn_nan_in_the_middle_of_decoding_end_the_request_with_an_error(tmp_path: Path) -> None:
    llm = load(poison_positions(build_model(tmp_path / "late-nan", "genai-dense"), 40), threads=1)
    prompt = list(range(3, 13))  # positions 0-9 are finite: the prompt passes its check
    assert len(llm.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids) == 20  # the control
    for params in ({}, {"logprobs": True}, {"temperature": 0.8, "seed": 1}):  # (a sampler says so itself)
        with pytest.raises(GenerationError, match=r"non-finite logits|cannot sample: the logits are NaN"):
            llm.generate(prompt, max_new_tokens=60, ignore_eos=True, **params)
        with pytest.raises(GenerationError, match=r"non-finite logits|cannot sample: the logits are NaN"):
            list(llm.stream(prompt, max_new_tokens=60, ignore_eos=True, **params))
    with pytest.raises(GenerationError, match="non-finite logits"):  # drafts verified by the model
        llm.generate(prompt * 3, max_new_tokens=60, ignore_eos=True, speculative=PromptLookup(4))
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with client(llm, SecurityConfig()) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and "non-finite logits" in r.json()["error"]["message"], r.text
        streamed = c.post("/v1/completions", json={**body, "stream": True}).text
        assert "non-finite logits" in streamed and '"type":"server_error"' in streamed, streamed[-500:]
        assert c.post("/v1/completions", json={**body, "max_tokens": 20}).status_code == 200


OPTIONAL_500 = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}


def _schema_body(free: int) -> dict:
    """A chat body whose schema reaches 500 optional properties (past llguidance's row limit) after
    ``free`` one-character strings, each a free choice (a character, or the closing quote)."""
    properties = {f"s{i}": {"type": "string", "maxLength": 1} for i in range(free)}
    schema = {
        "type": "object",
        "properties": {**properties, "b": OPTIONAL_500},
        "required": [*properties, "b"],
    }
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 80,
        "json_extra_properties": True,  # the permissive reading: every optional key allowed again
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def test_a_schema_that_hits_a_parser_limit_after_a_few_free_choices_is_refused_before_decoding(
    llm: LLM,
) -> None:
    with client(llm, SecurityConfig()) as c:
        for free in (0, 1, 2):
            for stream in (False, True):
                r = c.post("/v1/chat/completions", json={**_schema_body(free), "stream": stream})
                assert r.status_code == 400 and "too many alternatives" in r.json()["error"]["message"]


def test_a_schema_that_hits_a_parser_limit_in_the_middle_of_the_output_is_a_client_error(llm: LLM) -> None:
    body = _schema_body(6)  # beyond what the admission probe follows
    with client(llm, SecurityConfig()) as c:
        r = c.post("/v1/chat/completions", json=body)  # the probe passes: the limit is after a free choice
        assert r.status_code == 400 and "too many alternatives" in r.json()["error"]["message"]
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True}).text
        assert '"type":"invalid_request_error"' in streamed and "too many alternatives" in streamed
        assert _count(c, "chat", "500") == 0


def test_an_api_key_with_surrounding_whitespace_is_refused_at_start() -> None:
    for key in (" s3cret", "s3cret\n", "\ts3cret "):
        with pytest.raises(ValueError, match="whitespace"):
            SecurityConfig(api_key=key)
    with pytest.raises(ValueError, match="whitespace"):
        SecurityConfig(api_key=("fine", "s3cret "))


def test_several_api_keys_each_let_requests_in(llm: LLM) -> None:
    with client(llm, SecurityConfig(api_key=(KEY, "other-key"))) as c:
        for key in (KEY, "other-key"):
            assert c.post("/v1/completions", json=BODY, headers=bearer(key)).status_code == 200
        assert c.post("/v1/completions", json=BODY, headers=bearer("third")).status_code == 401


def test_a_client_that_resets_mid_body_is_logged_as_gone_not_as_a_server_error(llm: LLM) -> None:
    app = create_app(llm, CONFIG)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    incoming = [
        {"type": "http.request", "body": b'{"prompt": "ab', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # no exception leaves the app (no traceback in the log)
    assert sent[0]["status"] == 499
    metrics = app.state.server.metrics.render().decode()  # type: ignore[attr-defined]
    assert 'onnxgen_requests_total{endpoint="completions",status="499"} 1.0' in metrics
    assert 'status="500"' not in metrics
