"""``onnxgen serve`` against the bad-request catalogue and huge requests: 4xx for each, no stall, no harm."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess

from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.abuse import EIGHT_MIB_PROMPT, JSON, catalogue, trickle, unread_stream

MODEL = "dense2k"
MAX_BATCH = 4
MAX_QUEUE = 4
WIDE = {f"p{i}": {"type": "string"} for i in range(3000)}
WIDE_SCHEMA = {"type": "object", "properties": WIDE, "required": list(WIDE)}
GREEDY = {"model": MODEL, "prompt": "the zebra-unicorn said", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("server-hardening")
    model = build_model(root / MODEL, "genai-dense", TinySpec(max_position=2048))
    flags = ("--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE))
    proc = ServerProcess(model, root / "server.log", *flags)
    proc.baseline = greedy_text(proc)  # type: ignore[attr-defined]
    yield proc
    proc.close()


def greedy_text(server: ServerProcess) -> str:
    r = server.http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.mark.parametrize("abuse", catalogue(MODEL, MAX_BATCH, MAX_QUEUE), ids=lambda a: a.name)
def test_every_request_of_the_abuse_catalogue_gets_its_4xx_and_an_error_naming_the_problem(
    server: ServerProcess, abuse: Any
) -> None:
    r = server.http.request(abuse.method, abuse.path, content=abuse.body, headers=abuse.headers)
    assert r.status_code == abuse.status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert abuse.says in error["message"], error["message"]


def test_after_the_catalogue_the_server_gives_the_same_greedy_text_and_counted_no_5xx(
    server: ServerProcess,
) -> None:
    for abuse in catalogue(MODEL, MAX_BATCH, MAX_QUEUE):
        server.http.request(abuse.method, abuse.path, content=abuse.body, headers=abuse.headers)
    assert greedy_text(server) == server.baseline  # type: ignore[attr-defined]
    server_errors = {
        k: v for k, v in server.metrics().items() if dict(k[1]).get("status", "").startswith("5")
    }
    assert not any(server_errors.values()), server_errors
    assert server.metric("onnxgen_requests_total", endpoint="completions", status="415") >= 2


def test_each_request_gets_one_log_line_with_its_status_and_tokens_but_not_its_prompt(
    server: ServerProcess,
) -> None:
    greedy_text(server)
    server.http.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"})
    time.sleep(0.2)
    lines = server.log().splitlines()
    served = [line for line in lines if "POST /v1/completions 200 tokens=" in line]
    assert served and served[-1].startswith("onnxgen serve: POST /v1/completions 200 tokens=")
    prompt_tokens, completion_tokens = served[-1].split("tokens=")[1].split()[0].split("+")
    assert int(prompt_tokens) > 0 and int(completion_tokens) == 12
    assert served[-1].endswith(" ms")
    assert any("POST /v1/completions 415 tokens=0+0" in line for line in lines)
    assert "zebra" not in server.log()


def _health_during(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[list[float], int]:
    """Send ``body`` from another thread and time /health over and over until it has its answer."""
    content, status = json.dumps(body).encode(), []
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        client.get("/health")
        sender = threading.Thread(
            target=lambda: status.append(client.post(path, content=content, headers=JSON))
        )
        sender.start()
        latencies = []
        while sender.is_alive():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
        sender.join()
    return latencies, status[0].status_code


HUGE = {
    "8 MiB prompt": ("/v1/completions", {"prompt": EIGHT_MIB_PROMPT}, 400),
    "8 MiB chat message": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": EIGHT_MIB_PROMPT}]},
        400,
    ),
    "8 MiB prompt to /tokenize": ("/tokenize", {"prompt": EIGHT_MIB_PROMPT}, 400),
    "8 MiB chat message to /tokenize": (
        "/tokenize",
        {"messages": [{"role": "user", "content": EIGHT_MIB_PROMPT}]},
        400,
    ),
    "4000 chat messages": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}] * 4000},
        400,
    ),
    "a schema of 3000 properties": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WIDE_SCHEMA}},
        },
        200,
    ),
}


@pytest.mark.parametrize("huge", HUGE)
def test_health_answers_within_100_ms_while_a_huge_request_is_prepared(
    server: ServerProcess, huge: str
) -> None:
    path, body, status = HUGE[huge]
    latencies, got = _health_during(server, path, {"model": MODEL, **body})
    assert got == status  # 400: longer than the context
    assert latencies, "the request was answered before /health could be asked"
    assert max(latencies) < 0.1, f"/health took up to {1000 * max(latencies):.0f} ms during {huge}"


def test_slow_bodies_are_cut_off_within_seconds_and_never_hold_back_other_requests(
    server: ServerProcess,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        slow = [pool.submit(trickle, server.port, seconds=10.0) for _ in range(8)]
        time.sleep(0.5)  # the eight are reading their bodies
        start = time.perf_counter()
        with httpx.Client(base_url=server.base_url, timeout=5) as client:
            r = client.post("/v1/completions", json={**GREEDY, "max_tokens": 1})
        assert r.status_code == 200 and time.perf_counter() - start < 2.0
        assert [f.result() for f in slow] == [408] * 8


def test_a_client_that_stops_reading_its_stream_has_its_request_ended(server: ServerProcess) -> None:
    body = {  # chunks of about 1.5 KB: far more than the sockets' buffers hold
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1900,
        "n": 4,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
        "ignore_eos": True,
    }
    generated = server.metric("onnxgen_generation_tokens_total")
    seen = [generated]

    def stalled() -> bool:  # it started, and no token came since the last look: ended, or done
        seen.append(server.metric("onnxgen_generation_tokens_total"))
        return seen[-1] == seen[-2] > generated

    received = unread_stream(server.port, "/v1/chat/completions", body, 30.0, stalled)
    assert b"the client read none of this stream" in received and b"[DONE]" not in received
    assert server.metric("onnxgen_generation_tokens_total") - generated < 4 * 1900 / 2
    assert greedy_text(server) == server.baseline  # type: ignore[attr-defined]
