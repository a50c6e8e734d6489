"""The in-process ASGI runner the Ray replicas use, on the real ``onnxgen serve`` app of a tiny model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from onnxgen.server.security import SecurityConfig
from onnxgen.serving.asgi import AppRunner, ForwardedRequest, ResponseHead
from onnxgen.serving.engine import EngineSpec, load_app
from onnxgen.testing import build_model

HOST = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")]


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> EngineSpec:
    model = build_model(tmp_path_factory.mktemp("asgi") / "dense", "genai-dense")
    return EngineSpec(str(model), threads=1, max_batch=2, served_model_name="tiny", min_rows=1)


@pytest.fixture(scope="module")
def reference(spec: EngineSpec) -> Iterator[TestClient]:
    app, _ = load_app(spec)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def _post(path: str, body: dict[str, object]) -> ForwardedRequest:
    return ForwardedRequest(
        "POST", path, headers=HOST, body=json.dumps(body).encode(), client=("127.0.0.1", 1)
    )


async def _run(
    app: FastAPI, *requests: ForwardedRequest, stop_after: int | None = None
) -> list[list[ResponseHead | bytes]]:
    """Each request's parts, through one runner (an app's lifespan runs once); with ``stop_after`` the
    caller leaves after that many parts and the runner stops once the app has seen it go."""
    runner = AppRunner(app, [(b"x-served-by", b"me")])
    await runner.start()
    answers = []
    try:
        for request in requests:
            parts: list[ResponseHead | bytes] = []
            calls = runner.call(request)
            async for part in calls:
                parts.append(part)
                if stop_after is not None and len(parts) == stop_after:
                    await calls.aclose()  # the caller goes away
                    for _ in range(100):
                        if _finished(app).get("cancelled"):
                            break
                        await asyncio.sleep(0.05)
                    break
            answers.append(parts)
    finally:
        await runner.stop()
    return answers


def _finished(app: FastAPI) -> dict[str, float]:
    samples = app.state.server.metrics.finished.collect()[0].samples
    return {s.labels["reason"]: s.value for s in samples if s.name.endswith("_total")}


def test_a_forwarded_request_gets_the_apps_own_response_with_the_extra_headers(
    spec: EngineSpec, reference: TestClient
) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    bad_body = {**body, "max_tokens": 0}
    app, _ = load_app(spec)
    parts, bad = asyncio.run(_run(app, _post("/v1/completions", body), _post("/v1/completions", bad_body)))
    head = parts[0]
    assert isinstance(head, ResponseHead) and head.status == 200 and head.header("x-served-by") == "me"
    got = json.loads(b"".join(p for p in parts[1:] if isinstance(p, bytes)))
    want = reference.post("/v1/completions", json=body).json()
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    assert isinstance(bad[0], ResponseHead) and bad[0].status == 400
    assert json.loads(bad[1]) == reference.post("/v1/completions", json=bad_body).json()  # type: ignore[arg-type]


def test_a_stream_arrives_in_chunks_and_a_caller_that_leaves_cancels_the_generation(spec: EngineSpec) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
    app, _ = load_app(spec)
    (parts,) = asyncio.run(_run(app, _post("/v1/completions", body), stop_after=3))
    assert isinstance(parts[0], ResponseHead)
    assert (parts[0].header("content-type") or "").startswith("text/event-stream")
    assert all(isinstance(p, bytes) and p.startswith(b"data: ") for p in parts[1:])
    assert _finished(app) == {"cancelled": 1.0}  # stopped by the disconnect, not run to 400 tokens


def test_an_app_that_fails_before_answering_gives_a_500_and_a_failed_startup_raises() -> None:
    async def broken(scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "lifespan":
            return  # ends without completing startup
        raise RuntimeError("boom")

    async def call() -> list[ResponseHead | bytes]:
        runner = AppRunner(broken)  # type: ignore[arg-type]
        return [part async for part in runner.call(ForwardedRequest("GET", "/x"))]

    head, body = asyncio.run(call())
    assert isinstance(head, ResponseHead) and head.status == 500 and b"boom" in body  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="startup failed"):
        asyncio.run(AppRunner(broken).start())  # type: ignore[arg-type]


def test_the_replica_app_keeps_the_servers_guard(spec: EngineSpec) -> None:
    app, _ = load_app(EngineSpec(spec.model, threads=1, min_rows=1, security=SecurityConfig(api_key="k")))
    ((head, body),) = asyncio.run(_run(app, ForwardedRequest("GET", "/v1/models", headers=HOST)))
    assert isinstance(head, ResponseHead) and head.status == 401 and b"API key" in body  # type: ignore[operator]
