"""Concurrent requests decode in one batch and each returns exactly what it returns alone.

One server per model family: dense with a shared KV buffer (GroupQueryAttention), hybrid with a shared KV
buffer and mRoPE position ids, hybrid with a growing KV cache, dense int4 on int8 activations (whose
MatMulNBits kernel computes a single row differently from several), dense with a GPT-2 style stacked KV
cache and hybrid with a static (TensorScatter) KV cache. Rows have different prompt lengths,
join the batch at different steps and carry different sampling parameters.

"Alone" is checked two ways: the same request sent alone to the same server (always identical: a row's
output does not depend on the batch), and ``LLM.generate`` in process (fp32 exports: identical unless a
near-tie flips, which is reported with its logit margin; the int8-activation export decodes a single row
on another kernel there, so it is compared with the server alone only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from server_helpers import CACHE_VARIANTS, INT8_ACTIVATIONS, ServerProcess

from onnxgen import LLM, SamplingParams, load

FAMILIES = ("genai-dense", "hybrid-genai", "hybrid-mobius", INT8_ACTIVATIONS, *CACHE_VARIANTS)
LENGTHS = (1, 3, 7, 12, 20, 28, 35, 44, 52, 60)
NEW_TOKENS = 40
NEAR_TIE = (
    1e-3  # a token may flip only where the two best logits are this close (batched matmuls round apart)
)


def prompt(k: int, length: int) -> list[int]:
    return [(37 * i + 11 * k) % 300 + 3 for i in range(length)]


# (prompt, extra request fields): greedy rows, plus sampled and penalised rows in the same batch.
REQUESTS = [(prompt(k, n), {}) for k, n in enumerate(LENGTHS)] + [
    (prompt(20, 9), {"temperature": 0.9, "seed": 4}),
    (prompt(21, 16), {"presence_penalty": 1.0, "top_k": 20}),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def served(
    family: str, server_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, LLM]]:
    log = tmp_path_factory.mktemp(f"server-{family}") / "server.log"
    proc = ServerProcess(server_models[family], log, "--max-batch", "16")
    yield proc, load(server_models[family], threads=1)
    proc.close()


def params_of(fields: dict[str, Any]) -> SamplingParams:
    given = {"temperature": 0.0, **fields}
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **given)


async def _ask_all(server: ServerProcess, one_at_a_time: bool = False) -> list[list[int]]:
    client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )

    async def one(i: int, ids: list[int], fields: dict[str, Any]) -> list[int]:
        await asyncio.sleep(0 if one_at_a_time else 0.002 * i)  # spread arrivals: rows join a running batch
        std = {k: v for k, v in fields.items() if k in ("temperature", "seed", "presence_penalty")}
        extra = {k: v for k, v in fields.items() if k not in std}
        kw: dict[str, Any] = {"temperature": 0.0, **std}
        extra_body = {"ignore_eos": True, "return_token_ids": True, **extra}
        if i % 2:  # half of them stream
            stream = await client.completions.create(
                model=server.model_name,
                prompt=ids,
                max_tokens=NEW_TOKENS,
                stream=True,
                extra_body=extra_body,
                **kw,
            )
            return [t async for chunk in stream for t in chunk.choices[0].model_extra["token_ids"]]
        r = await client.completions.create(
            model=server.model_name, prompt=ids, max_tokens=NEW_TOKENS, extra_body=extra_body, **kw
        )
        return list(r.choices[0].model_extra["token_ids"])

    try:
        if one_at_a_time:
            return [await one(i, ids, f) for i, (ids, f) in enumerate(REQUESTS)]
        return await asyncio.gather(*[one(i, ids, f) for i, (ids, f) in enumerate(REQUESTS)])
    finally:
        await client.close()


def divergence_margin(llm: LLM, ids: list[int], alone: list[int], served: list[int]) -> tuple[int, float]:
    """Where two greedy runs first differ and the logit margin between their two tokens there."""
    at = next(i for i, (a, b) in enumerate(zip(alone, served, strict=True)) if a != b)
    state = llm.session.new_state(len(ids) + len(alone) + 1)
    logits = llm.session.forward(state, np.asarray([ids + alone[:at]]), 1)[0, -1]
    return at, float(abs(logits[alone[at]] - logits[served[at]]))


def assert_same_as_in_process(llm: LLM, outputs: list[list[int]]) -> None:
    """Each output equals LLM.generate of the same request, or flips only at a near-tie (margin shown)."""
    for (ids, fields), got in zip(REQUESTS, outputs, strict=True):
        alone = llm.generate(ids, params_of(fields)).token_ids
        if got != alone:
            assert not fields or fields.get("temperature", 0) == 0, f"sampled row {fields} diverged"
            at, margin = divergence_margin(llm, ids, alone, got)
            assert margin < NEAR_TIE, (
                f"prompt of {len(ids)} tokens diverges at token {at}, logit margin {margin}"
            )


def test_concurrent_requests_of_different_lengths_each_return_what_they_return_alone(
    served: tuple[ServerProcess, LLM], family: str
) -> None:
    server, llm = served
    alone_served = asyncio.run(_ask_all(server, one_at_a_time=True))
    steps_before = server.metrics()
    outputs = asyncio.run(_ask_all(server))
    assert outputs == alone_served  # to the token, sampled and penalised rows included
    assert all(len(got) == NEW_TOKENS for got in outputs)
    if family != INT8_ACTIVATIONS:  # there LLM.generate decodes one row on another kernel
        assert_same_as_in_process(llm, outputs)
    after = server.metrics()

    def steps_above(size: int) -> float:
        key_all, key_le = (
            ("onnxgen_batch_size_count", ()),
            ("onnxgen_batch_size_bucket", (("le", f"{size}.0"),)),
        )
        return (after[key_all] - steps_before.get(key_all, 0)) - (after[key_le] - steps_before.get(key_le, 0))

    assert steps_above(4) > 0, "the requests never shared a decode step; the test did not exercise batching"


def test_the_batch_decodes_in_fewer_forwards_than_one_at_a_time(served: tuple[ServerProcess, LLM]) -> None:
    server, _ = served
    before = server.metric("onnxgen_batch_size_count")
    asyncio.run(_ask_all(server))
    steps = server.metric("onnxgen_batch_size_count") - before
    sequential = len(REQUESTS) * (NEW_TOKENS - 1)  # decode steps when each request runs alone
    assert steps < sequential / 2
