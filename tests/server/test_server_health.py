"""``/health`` answers 503 whenever requests would not be served: while the model loads (the bound port's
:class:`LoadingResponder`), before the app's scheduler runs and after it stops; 200 in between."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from onnxgen import load
from onnxgen.cli.serve import bind
from onnxgen.server.app import create_app
from onnxgen.server.loading import LoadingResponder
from onnxgen.server.scheduler import SchedulerConfig


def test_the_port_answers_503_while_the_model_loads_and_stays_bound_for_the_app() -> None:
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with LoadingResponder(sock):
            health = httpx.get(f"{url}/health", timeout=5)
            assert (health.status_code, health.json()) == (503, {"status": "loading"})
            assert health.headers["retry-after"] == "1"
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 100_000}, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        with socket.create_connection(sock.getsockname(), timeout=1):
            pass  # still listening: the app takes the socket over
    finally:
        sock.close()


def test_health_is_503_until_the_scheduler_runs_and_after_it_stops(server_models: dict[str, Path]) -> None:
    llm = load(server_models["genai-dense"], threads=1)
    app = create_app(llm, SchedulerConfig(max_batch=2, max_model_len=256))
    idle = TestClient(app, base_url="http://127.0.0.1")  # no lifespan: the scheduler never started
    assert idle.get("/health").status_code == 503
    with TestClient(app, base_url="http://127.0.0.1") as running:
        assert running.get("/health").json() == {"status": "ok"}
    assert idle.get("/health").status_code == 503


def test_an_unknown_tool_call_parser_is_refused_when_the_app_is_made(server_models: dict[str, Path]) -> None:
    llm = load(server_models["genai-dense"], threads=1)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        create_app(llm, SchedulerConfig(max_batch=2, max_model_len=256), tool_parser="nope")
