"""Concurrent server requests that share a system prompt resume from the prefix cache and return what
plain decoding returns; usage and /metrics report the cached tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from server_helpers import ServerProcess

from onnxgen import SamplingParams, load

NEW_TOKENS = 12
SYSTEM = [int(t) for t in np.random.default_rng(1).integers(3, 250, 40)]


def question(k: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(100 + k).integers(3, 250, 5 + k)]


async def _ask(server: ServerProcess, prompts: list[list[int]]) -> list[Any]:
    client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    try:
        return await asyncio.gather(
            *[
                client.completions.create(
                    model=server.model_name,
                    prompt=ids,
                    max_tokens=NEW_TOKENS,
                    temperature=0.0,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                for ids in prompts
            ]
        )
    finally:
        await client.close()


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai", "hybrid-mobius"])
def test_concurrent_requests_sharing_a_prefix_resume_from_the_cache(
    family: str, server_models: dict[str, Path], tmp_path: Path
) -> None:
    model = server_models[family]
    server = ServerProcess(
        model,
        tmp_path / "server.log",
        "--prefix-cache-mb",
        "8",
        "--checkpoint-interval",
        "8",
        "--prefill-chunk",
        "16",
    )
    try:
        base = {  # (the server's start-up check generates a token)
            n: server.metric(n)
            for n in ("onnxgen_prefix_cache_queries_total", "onnxgen_prefix_cache_hits_total")
        }
        first = asyncio.run(_ask(server, [SYSTEM + question(0)]))[0]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        prompts = [SYSTEM + question(k) for k in range(1, 7)]
        replies = asyncio.run(_ask(server, prompts))
        plain = load(model, threads=1)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for ids, reply in zip(prompts, replies, strict=True):
            assert list(reply.choices[0].model_extra["token_ids"]) == plain.generate(ids, params).token_ids
            cached = reply.usage.prompt_tokens_details.cached_tokens
            # at least the checkpoint before the end of the system prompt
            assert 32 <= cached <= len(SYSTEM) + 1, cached
        queries = (
            server.metric("onnxgen_prefix_cache_queries_total") - base["onnxgen_prefix_cache_queries_total"]
        )
        hits = server.metric("onnxgen_prefix_cache_hits_total") - base["onnxgen_prefix_cache_hits_total"]
        assert queries == sum(map(len, [SYSTEM + question(0), *prompts]))
        assert hits == sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
        assert 0 < server.metric("onnxgen_prefix_cache_bytes") <= 8 << 20
        # an exact repeat of a finished request resumes before its last token
        again = asyncio.run(_ask(server, [prompts[0]]))[0]
        assert again.usage.prompt_tokens_details.cached_tokens == len(prompts[0]) - 1
        assert again.choices[0].model_extra["token_ids"] == replies[0].choices[0].model_extra["token_ids"]
    finally:
        server.close()
