"""The ingress's fault and back-pressure paths, driven with a stand-in for the engine handle (each call
answers a scripted sequence of parts or Ray's exceptions), so each path runs exactly once and fast.
The same paths on a real Ray instance: tests/serving/test_ray_serve.py. Skipped without Ray Serve."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.testclient import TestClient

from onnxgen.server.security import SecurityConfig
from onnxgen.serving.asgi import ForwardedRequest, ResponseHead
from onnxgen.serving.ray_ingress import REPLICA_HEADER, OnnxgenIngress

SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]
ROLE = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'


def _event(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': text}}]})}\n\n".encode()


class Stream:
    """A stand-in for a streaming DeploymentResponseGenerator: yields its parts, raising the exceptions."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts: Iterator[Any] = iter(parts)
        self.cancelled = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        part = next(self.parts, StopAsyncIteration())
        if isinstance(part, BaseException):
            raise part
        return part

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Answers the n-th call with the n-th script; keeps the requests and streams."""

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.requests: list[ForwardedRequest] = []
        self.streams: list[Stream] = []

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, request: ForwardedRequest) -> Stream:
        self.requests.append(request)
        self.streams.append(Stream(self.scripts.pop(0)))
        return self.streams[-1]


def _client(handle: Handle, retries: int = 2) -> tuple[TestClient, OnnxgenIngress]:
    ingress = OnnxgenIngress(handle, SecurityConfig(), retries)  # type: ignore[arg-type]
    return TestClient(ingress.__serve_build_asgi_app__(), base_url="http://127.0.0.1"), ingress


def _head(kind: list[tuple[bytes, bytes]], replica: str) -> ResponseHead:
    return ResponseHead(200, [*kind, (REPLICA_HEADER.encode(), replica.encode())])


def _metric(ingress: OnnxgenIngress, name: str) -> float:
    return ingress.metrics.registry.get_sample_value(name) or 0.0


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_full_queue_is_a_503_that_asks_to_retry_later() -> None:
    client, _ = _client(Handle([BackPressureError(num_queued_requests=8, max_queued_requests=8)]))
    response = client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "server_overloaded" and "queue is full" in error["message"]


def test_a_request_whose_replica_fails_before_any_token_is_sent_again_and_answered_once() -> None:
    dead = RayActorError(error_msg="the actor died")
    handle = Handle(
        [dead],  # died before its head
        [_head(SSE, "r2"), ROLE, dead],  # died after the role chunk, which carries no token
        [_head(SSE, "r3"), ROLE, _event("Hel"), _event("lo"), b"data: [DONE]\n\n"],
    )
    client, ingress = _client(handle)
    response = client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "r3"
    assert response.content == ROLE + _event("Hel") + _event("lo") + b"data: [DONE]\n\n"
    sent = [r.body for r in handle.requests]
    assert len(sent) == 3 and len(set(sent)) == 1 and json.loads(sent[0]) == BODY  # the same request
    assert _metric(ingress, "onnxgen_retried_requests_total") == 2
    assert handle.streams[0].cancelled and handle.streams[1].cancelled


def test_when_every_try_fails_before_output_the_client_gets_a_503_naming_it() -> None:
    dead = RayActorError(error_msg="the actor died")
    handle = Handle([dead], [dead])
    client, _ = _client(handle, retries=1)
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert response.status_code == 503 and len(handle.requests) == 2
    assert "failed before answering" in response.json()["error"]["message"]


def test_a_stream_cut_after_its_first_token_ends_with_an_error_event_and_is_not_resent() -> None:
    dead = RayActorError(error_msg="the actor died")
    handle = Handle([_head(SSE, "r1"), ROLE, _event("Hel"), dead], [_head(SSE, "unused")])
    client, ingress = _client(handle)
    response = client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200 and len(handle.requests) == 1
    events = response.content.split(b"\n\n")
    assert events[:2] == [ROLE.rstrip(), _event("Hel").rstrip()]
    error = json.loads(events[2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and "failed mid-stream" in error["message"]
    assert b"[DONE]" not in response.content
    assert _metric(ingress, "onnxgen_broken_responses_total") == 1


def test_a_non_streamed_answer_is_relayed_whole_with_its_own_length() -> None:
    body = b'{"choices": [{"text": "hello"}]}'
    handle = Handle([ResponseHead(200, [*JSON, (b"content-length", b"999")]), body[:10], body[10:]])
    client, _ = _client(handle)
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert response.status_code == 200 and response.content == body
    assert response.headers["content-length"] == str(len(body))
