"""onnxgen on Ray Serve: two engine replicas of the bundled model on a Ray instance started here.

Checked against the same app ``onnxgen serve`` runs, built in process from the same spec: the official
``openai`` client gets the same greedy outputs (streamed and not) and the same errors; a multi-turn
conversation stays on one replica; killing a replica mid-load leaves every other request answered and
the deployment back at two replicas. Skipped where Ray Serve is not installed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from onnxgen.llm import default_model_dir
from onnxgen.serving.engine import EngineSpec, load_app

PROMPTS = ("Once upon a time", "def fibonacci(n):", "The capital of France is")
NAME = "tiny"


@dataclass
class Deployment:
    url: str
    serve: Any
    ray: Any

    def replicas_running(self) -> int:
        status = self.serve.status().applications["onnxgen"].deployments["OnnxgenEngine"]
        return status.replica_states.get("RUNNING", 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SPEC = EngineSpec(str(default_model_dir()), threads=1, max_batch=4, max_queue=32, served_model_name=NAME)


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from onnxgen.serving.ray import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="onnxgen-test")
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(SPEC, replicas=2), name="onnxgen", route_prefix="/")
        yield Deployment(f"http://127.0.0.1:{port}", serve, ray)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference() -> Iterator[TestClient]:
    """The ``onnxgen serve`` app of the same spec, in process."""
    app, _ = load_app(SPEC)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def _completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}


def _chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": messages, "max_tokens": 24, "temperature": 0, **extra}


def _ingress_metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_the_openai_client_gets_the_same_greedy_outputs_and_errors_as_from_onnxgen_serve(
    deployment: Deployment, reference: TestClient
) -> None:
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt in PROMPTS:
        want = reference.post("/v1/completions", json=_completion(prompt)).json()["choices"][0]
        got = client.completions.create(**_completion(prompt))
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want["text"], want["finish_reason"])
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**_completion(prompt), stream=True)
        )
        assert streamed == want["text"]

        messages = [{"role": "user", "content": prompt}]
        want = reference.post("/v1/chat/completions", json=_chat(messages)).json()["choices"][0]
        got_chat = client.chat.completions.create(**_chat(messages))
        assert got_chat.choices[0].message.content == want["message"]["content"]
        chunks = client.chat.completions.create(**_chat(messages), stream=True)
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == want["message"]["content"]
        )
    assert [m.id for m in client.models.list()] == [NAME]

    bad = [
        ("/v1/completions", _completion("x", max_tokens=-1)),
        ("/v1/chat/completions", {"model": NAME, "messages": "not a list"}),
        ("/v1/completions", _completion("x", model="another-model")),
        ("/v1/nowhere", {}),
    ]
    for path, body in bad:
        got_error = httpx.post(f"{deployment.url}{path}", json=body, timeout=30)
        want_error = reference.post(path, json=body)
        assert got_error.status_code == want_error.status_code >= 400
        assert got_error.json() == want_error.json()
    not_json = httpx.post(f"{deployment.url}/v1/completions", content=b"{}", timeout=30)
    assert not_json.status_code == 415 and "application/json" in not_json.json()["error"]["message"]


def test_the_turns_of_a_conversation_go_to_the_replica_that_holds_its_prefix(deployment: Deployment) -> None:
    hits_before = _ingress_metric(deployment.url, "onnxgen_routed_requests_total", how="prefix")
    replicas_seen: set[str] = set()
    with httpx.Client(base_url=deployment.url, timeout=60) as http:
        for conversation in range(6):
            messages = [
                {"role": "system", "content": "You are a terse assistant."},
                {
                    "role": "user",
                    "content": f"Conversation {conversation}: name a colour that you like, and say why in a few words.",
                },
            ]
            served_by = []
            for turn in range(3):
                response = http.post("/v1/chat/completions", json=_chat(messages, max_tokens=8))
                assert response.status_code == 200, response.text
                served_by.append(response.headers["x-onnxgen-replica"])
                reply = response.json()["choices"][0]["message"]["content"]
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": f"And {turn}?"},
                ]
            # by chance (two replicas, no affinity) all six conversations stay put with probability 4^-6
            assert len(set(served_by)) == 1, served_by
            replicas_seen |= set(served_by)
    hits = _ingress_metric(deployment.url, "onnxgen_routed_requests_total", how="prefix") - hits_before
    assert hits == 6 * 2  # every follow-up turn is a prefix hit: hit rate 1.0
    assert replicas_seen <= {
        r for r in replicas_seen if r.startswith("SERVE_REPLICA::onnxgen#OnnxgenEngine#")
    }


LOAD_PROMPTS = tuple(f"Story {i}: once upon a time" for i in range(8))


class Load:
    """Sixteen concurrent completions (every other one streamed), each noting where it was answered."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.out: dict[int, tuple[int, str | None, bytes]] = {}
        self.streaming: dict[int, str] = {}  # streams whose first output came, by replica
        self.first_output = threading.Event()
        self.threads = [threading.Thread(target=self._one, args=(i,)) for i in range(16)]
        for t in self.threads:
            t.start()

    def _one(self, index: int) -> None:
        stream = index % 2 == 1
        body = _completion(LOAD_PROMPTS[index % 8], max_tokens=48, ignore_eos=True, stream=stream)
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
                replica = response.headers.get("x-onnxgen-replica")
                if stream and replica:
                    self.streaming[index] = replica
                    self.first_output.set()
                self.out[index] = (response.status_code, replica, response.read())
        except httpx.HTTPError as e:
            self.out[index] = (0, None, repr(e).encode())

    def join(self) -> None:
        for t in self.threads:
            t.join(120)


def _streamed_text(raw: bytes) -> tuple[str, bool, str | None]:
    """(text, whether [DONE] came, the error message of an error event)."""
    text, done, error = "", False, None
    for line in raw.decode().splitlines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            else:
                text += "".join(c["text"] for c in event["choices"])
    return text, done, error


def test_killing_a_replica_mid_load_leaves_the_other_requests_answered_and_two_replicas_running(
    deployment: Deployment, reference: TestClient
) -> None:
    full = {"max_tokens": 48, "ignore_eos": True}
    want = {p: reference.post("/v1/completions", json=_completion(p, **full)).json() for p in LOAD_PROMPTS}
    retried_before = _ingress_metric(deployment.url, "onnxgen_retried_requests_total")
    broken_before = _ingress_metric(deployment.url, "onnxgen_broken_responses_total")
    load = Load(deployment.url)
    assert load.first_output.wait(60)
    victim = next(iter(load.streaming.values()))  # a replica with a stream under way
    deployment.ray.kill(deployment.ray.get_actor(victim, namespace="serve"), no_restart=True)
    load.join()
    assert len(load.out) == 16
    for index, (status, replica, raw) in load.out.items():
        expected = want[LOAD_PROMPTS[index % 8]]["choices"][0]["text"]
        assert status == 200, raw
        if index % 2 == 0:  # not streamed: answered in full, by a survivor or sent again before any output
            assert json.loads(raw)["choices"][0]["text"] == expected
            continue
        text, done, error = _streamed_text(raw)
        if done:
            assert text == expected
        else:  # cut mid-stream: only on the replica that died, and said so
            assert replica == victim and error is not None and "failed mid-stream" in error, raw
            assert expected.startswith(text)
    assert any(replica != victim for _, replica, _ in load.out.values())  # the survivor served some
    lost = _ingress_metric(deployment.url, "onnxgen_retried_requests_total") - retried_before
    lost += _ingress_metric(deployment.url, "onnxgen_broken_responses_total") - broken_before
    assert lost >= 1  # the replica died with requests in flight

    deadline = time.monotonic() + 90
    while deployment.replicas_running() != 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert deployment.replicas_running() == 2
    after = httpx.post(f"{deployment.url}/v1/completions", json=_completion(PROMPTS[0]), timeout=60)
    assert after.status_code == 200 and after.headers["x-onnxgen-replica"] != victim
