"""Speculative requests through a live server (``--speculative`` server-wide, the ``speculative`` field per
request) return what the library returns for them, while plain requests decode beside them."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import ServerProcess

from onnxgen import LLM, PromptLookup, SamplingParams, load

NEW_TOKENS = 14


def lookup_prompts(llm: LLM) -> list[list[int]]:
    """Prompts that repeat a head and the model's own continuation of it (prompt lookup's drafts get
    accepted)."""
    out = []
    for k, n in enumerate((6, 9, 4, 11)):
        head = [(37 * i + 11 * k) % 300 + 3 for i in range(n)]
        head += head[:5] + head
        reply = llm.generate(head, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        out.append(head + reply[:6] + head + reply[:3])
    return out


async def _ask(server: ServerProcess, bodies: list[dict[str, Any]]) -> list[Any]:
    client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    base = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True}
    try:
        return await asyncio.gather(
            *[
                client.completions.create(
                    model=server.model_name,
                    prompt=body.pop("prompt"),
                    temperature=body.pop("temperature", 0.0),
                    seed=body.pop("seed", None),
                    extra_body={**base, **body},
                )
                for body in bodies
            ]
        )
    finally:
        await client.close()


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_speculative_requests_equal_the_library_beside_plain_ones(
    family: str, server_models: dict[str, Path], tmp_path: Path
) -> None:
    model = server_models[family]
    llm = load(model, threads=1)
    prompts = lookup_prompts(llm)
    server = ServerProcess(
        model, tmp_path / "server.log", "--speculative", "prompt-lookup", "--draft-tokens", "3"
    )
    try:
        replies = asyncio.run(
            _ask(
                server,
                [
                    {"prompt": prompts[0]},  # the server's default: prompt lookup, 3 drafts
                    {"prompt": prompts[1], "speculative": {"method": "off"}},
                    {
                        "prompt": prompts[2],
                        "temperature": 0.8,
                        "seed": 11,
                        "speculative": {"method": "prompt-lookup", "num_draft_tokens": 3, "adaptive": False},
                    },
                    {"prompt": prompts[3], "speculative": {"method": "prompt-lookup", "num_draft_tokens": 2}},
                    {"prompt": prompts[0], "temperature": 0.8, "seed": 5, "speculative": {"method": "off"}},
                ],
            )
        )
        # the greedy speculative requests decoded as batch rows beside the plain ones for a while
        assert server.metric("onnxgen_speculative_yields_total") >= 1
    finally:
        server.close()
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [
        llm.generate(prompts[0], greedy, speculative=PromptLookup(3)),
        llm.generate(prompts[1], greedy),
        llm.generate(
            prompts[2], replace(greedy, temperature=0.8, seed=11), speculative=PromptLookup(3, adaptive=False)
        ),
        llm.generate(prompts[3], greedy, speculative=PromptLookup(2)),
        llm.generate(prompts[0], replace(greedy, temperature=0.8, seed=5)),
    ]
    for reply, want in zip(replies, expected, strict=True):
        assert reply.choices[0].model_extra["token_ids"] == want.token_ids
    assert sum(r.stats.get("accepted_draft_tokens", 0) for r in expected) > 0


def test_speculative_methods_the_server_cannot_run_are_refused(
    server_models: dict[str, Path], tmp_path: Path
) -> None:
    server = ServerProcess(server_models["genai-dense"], tmp_path / "server.log")
    try:
        for method, says in (("mtp", "MTP"), ("draft", "no draft model"), ("beam", "speculative.method")):
            r = server.http.post(
                "/v1/completions",
                json={"prompt": [5, 6, 7], "max_tokens": 2, "speculative": {"method": method}},
            )
            assert r.status_code == 400, r.text
            assert says in r.json()["error"]["message"], r.text
        r = server.http.post(
            "/v1/completions",
            json={
                "prompt": [5, 6],
                "max_tokens": 2,
                "speculative": {"method": "prompt-lookup", "num_draft_tokens": 99},
            },
        )
        assert r.status_code == 400 and "num_draft_tokens" in r.text
        # a plain request still runs
        ok = server.http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        server.close()


def test_a_speculative_request_on_int8_activations_returns_plain_greedy_tokens(tmp_path: Path) -> None:
    """On an int4 export with int8 activations a server-wide ``--speculative`` request gives plain greedy
    decoding's 200 tokens whatever this CPU's verify kernels do (speculation runs only where a verify is
    exact: tests/speculative/test_verify_exactness.py)."""
    from onnxgen.testing import build_model, int8_activations

    model = int8_activations(build_model(tmp_path / "int4", "genai-dense", precision="int4"))
    prompt = [5, 17, 200, 33, 44, 91, 12, 8, 5, 17, 200, 33, 44, 91, 12, 8, 5, 17, 200, 33]
    want = load(model, threads=1).generate(prompt, max_new_tokens=200, ignore_eos=True).token_ids
    server = ServerProcess(model, tmp_path / "server.log", "--speculative", "prompt-lookup")
    try:
        r = server.http.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 200,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        server.close()
