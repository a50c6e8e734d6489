"""``onnxgen serve`` under bad input, slow and vanishing clients, a full queue; and what /metrics says."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_helpers import ServerProcess

from onnxgen.testing import TinySpec, build_model

MODEL = "dense2k"
MAX_BATCH = 4
MAX_QUEUE = 4
LONG = 1800  # tokens a long request asks for: seconds of decoding, so it is still running when the test acts


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("server-robustness")
    model = build_model(root / MODEL, "genai-dense", TinySpec(max_position=2048))
    flags = ("--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE))
    proc = ServerProcess(model, root / "server.log", *flags)
    yield proc
    proc.close()


def long_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "a long one",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def wait_until(server: ServerProcess, name: str, value: float, timeout: float = 15.0, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while server.metric(name, **labels) != value:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{name}{labels} stayed at {server.metric(name, **labels)}, expected {value}"
            )
        time.sleep(0.05)


# -- bad requests ---------------------------------------------------------------------------------------
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_REQUESTS = [
    ("completions", b"{not json", 400, "not valid JSON"),
    ("completions", [1, 2], 400, "JSON object"),
    ("completions", {**OK, "model": "other"}, 404, "not served here"),
    ("completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {**OK, "temperature": 3.5}, 400, "temperature"),
    ("completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("completions", {**OK, "n": 0}, 400, "n"),
    ("completions", {**OK, "n": MAX_BATCH + 1}, 400, "exceeds this server's batch"),
    ("completions", {**OK, "stop": [""]}, 400, "stop"),
    ("completions", {**OK, "stop": [f"s{i}" for i in range(17)]}, 400, "at most 16 stop strings"),
    ("completions", {**OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {**OK, "seed": -1}, 400, "seed"),
    ("completions", {**OK, "min_tokens": 5}, 400, "min_tokens"),
    ("completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("completions", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("completions", {**OK, "stop_token_ids": [5, 99999]}, 400, "stop_token_ids"),
    ("completions", {**OK, "logit_bias": {"5": 101.0}}, 400, "logit_bias[5] must be in [-100, 100]"),
    ("completions", {**OK, "logit_bias": {"x": 1.0}}, 400, "logit_bias must be keyed by token ids"),
    ("completions", {**OK, "logit_bias": {"99999": 1.0}}, 400, "outside the model's vocabulary"),
    ("completions", {**OK, "echo": True}, 400, "echo"),
    ("completions", {**OK, "prompt": ""}, 400, "empty"),
    ("completions", {**OK, "prompt": []}, 400, "empty"),
    ("completions", {**OK, "prompt": [5, 99999]}, 400, "outside the model's vocabulary"),
    ("completions", {**OK, "prompt": [7] * 2100}, 400, "this server's context holds 2048 tokens"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "content",
    ),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("chat/completions", {**CHAT, "tool_choice": "required"}, 400, "defines no tools"),
    ("chat/completions", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs needs logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {**CHAT, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        400,
        "messages.0.tool_calls.0.function",
    ),
    ("chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x " * 2100}]},
        400,
        "context holds",
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "says"), BAD_REQUESTS)
def test_a_bad_request_gets_an_openai_style_error_body_with_a_4xx_status(
    server: ServerProcess, endpoint: str, body: Any, status: int, says: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = server.http.post(f"/v1/{endpoint}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in error["message"] or says == error["param"], error


def test_unknown_routes_and_methods_and_oversized_bodies_get_error_bodies(server: ServerProcess) -> None:
    assert server.http.post("/v1/nothing", json={}).json()["error"]["type"] == "not_found_error"
    assert server.http.get("/v1/completions").status_code == 405
    huge = server.http.post(
        "/v1/completions", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"}
    )
    assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]


def test_the_openai_client_raises_its_bad_request_error_and_the_server_keeps_serving(
    server: ServerProcess,
) -> None:
    with pytest.raises(openai.BadRequestError, match="context holds 2048"):
        server.client.completions.create(model=MODEL, prompt=[3] * 2500, max_tokens=3)
    assert server.http.get("/health").status_code == 200
    assert (
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    )


# -- streaming, disconnects, backpressure ---------------------------------------------------------------
def test_streamed_chunks_arrive_while_tokens_are_generated_not_in_one_burst(server: ServerProcess) -> None:
    start = time.perf_counter()
    arrivals = []
    stream = server.client.completions.create(
        model=MODEL,
        prompt="tick",
        max_tokens=300,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        arrivals.append(time.perf_counter() - start)
        assert len(chunk.choices[0].model_extra["token_ids"]) == 1  # one chunk per token
    assert len(arrivals) == 300
    first, last = arrivals[0], arrivals[-1]
    assert first < 0.5 * last, f"first chunk at {first:.3f} s, last at {last:.3f} s"
    middle = arrivals[150]
    assert first < middle < last and (middle - first) > 0.2 * (last - first)


def test_a_client_disconnect_mid_stream_cancels_its_request_and_frees_its_slot(server: ServerProcess) -> None:
    cancelled = server.metric("onnxgen_sequences_finished_total", reason="cancelled")
    generated = server.metric("onnxgen_generation_tokens_total")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        streams = [
            client.stream("POST", "/v1/completions", json=long_body(stream=True)) for _ in range(MAX_BATCH)
        ]
        responses = [s.__enter__() for s in streams]
        lines = [r.iter_lines() for r in responses]  # kept: a dropped iterator closes its response
        for r, line in zip(responses, lines, strict=True):  # every row is busy: each stream has a token out
            assert r.status_code == 200
            assert next(line).startswith("data: ")
        wait_until(server, "onnxgen_free_batch_rows", 0)
        for s in streams:
            s.__exit__(None, None, None)
    wait_until(server, "onnxgen_sequences_finished_total", cancelled + MAX_BATCH, reason="cancelled")
    wait_until(server, "onnxgen_free_batch_rows", MAX_BATCH)
    assert server.metric("onnxgen_running_sequences") == 0
    assert server.metric("onnxgen_generation_tokens_total") - generated < MAX_BATCH * LONG
    r = server.client.completions.create(
        model=MODEL, prompt="after", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 4


def test_a_queued_request_whose_client_leaves_gives_its_queue_place_back(server: ServerProcess) -> None:
    cancelled = server.metric("onnxgen_sequences_finished_total", reason="cancelled")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        running = [
            client.stream("POST", "/v1/completions", json=long_body(stream=True)) for _ in range(MAX_BATCH)
        ]
        lines = [r.__enter__().iter_lines() for r in running]
        for line in lines:
            assert next(line).startswith("data: ")
        queued = [
            client.stream("POST", "/v1/completions", json=long_body(stream=True)) for _ in range(MAX_QUEUE)
        ]
        for q in queued:
            assert q.__enter__().status_code == 200
        wait_until(server, "onnxgen_queue_depth", MAX_QUEUE)
        for q in queued:
            q.__exit__(None, None, None)
        wait_until(server, "onnxgen_queue_depth", 0)  # while every row is still busy
        assert server.metric("onnxgen_free_batch_rows") == 0
        for r in running:
            r.__exit__(None, None, None)
    wait_until(
        server, "onnxgen_sequences_finished_total", cancelled + MAX_BATCH + MAX_QUEUE, reason="cancelled"
    )
    wait_until(server, "onnxgen_free_batch_rows", MAX_BATCH)


def test_a_client_that_gives_up_on_a_non_streamed_request_cancels_it(server: ServerProcess) -> None:
    cancelled = server.metric("onnxgen_sequences_finished_total", reason="cancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=long_body(), timeout=0.5)
    wait_until(server, "onnxgen_sequences_finished_total", cancelled + 1, reason="cancelled")
    wait_until(server, "onnxgen_free_batch_rows", MAX_BATCH)


async def _flood(server: ServerProcess, count: int) -> list[tuple[int, dict[str, Any] | None, str | None]]:
    """Open ``count`` long streams at once; return (status, error body, Retry-After) of each, then hang up."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:

        async def one() -> tuple[int, dict[str, Any] | None, str | None, Any]:
            request = client.build_request("POST", "/v1/completions", json=long_body(stream=True))
            r = await client.send(request, stream=True)
            body = json.loads(await r.aread()) if r.status_code != 200 else None
            return r.status_code, body, r.headers.get("retry-after"), r

        results = await asyncio.gather(*[one() for _ in range(count)])
        for *_, r in results:
            await r.aclose()
    return [(status, body, retry) for status, body, retry, _ in results]


def test_a_full_queue_answers_503_with_an_error_body_and_accepted_requests_are_served(
    server: ServerProcess,
) -> None:
    results = asyncio.run(_flood(server, MAX_BATCH + MAX_QUEUE + 4))
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(accepted) + len(refused) == len(results)
    assert len(accepted) >= MAX_QUEUE and len(refused) >= 4
    for _, body, retry in refused:
        assert body is not None and body["error"]["code"] == "queue_full" and retry == "1"
    wait_until(server, "onnxgen_free_batch_rows", MAX_BATCH)
    wait_until(server, "onnxgen_queue_depth", 0)


# -- metrics --------------------------------------------------------------------------------------------
def test_metrics_count_the_requests_tokens_and_latencies_of_the_traffic(server: ServerProcess) -> None:
    before = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return server.metrics().get(key, 0.0) - before.get(key, 0.0)

    usages = [
        server.client.completions.create(
            model=MODEL, prompt=p, max_tokens=5, extra_body={"ignore_eos": True}
        ).usage
        for p in ("one", "two three")
    ]
    chat = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chat_usage = [c.usage for c in chat if c.usage is not None][-1]
    server.http.post("/v1/completions", json={**OK, "max_tokens": 0})
    prompt_tokens = sum(u.prompt_tokens for u in usages) + chat_usage.prompt_tokens
    assert delta("onnxgen_requests_total", endpoint="completions", status="200") == 2
    assert delta("onnxgen_requests_total", endpoint="chat", status="200") == 1
    assert delta("onnxgen_requests_total", endpoint="completions", status="400") == 1
    assert delta("onnxgen_prompt_tokens_total") == prompt_tokens
    assert delta("onnxgen_generation_tokens_total") == 14
    assert delta("onnxgen_sequences_finished_total", reason="length") == 3
    assert delta("onnxgen_time_to_first_token_seconds_count") == 3
    assert delta("onnxgen_time_per_output_token_seconds_count") == 11  # every token after the first
    assert delta("onnxgen_batch_size_count") >= 4  # at least the decode steps of the longest request
    assert server.metric("onnxgen_queue_depth") == 0
    assert server.metric("onnxgen_running_sequences") == 0
