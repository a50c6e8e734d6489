"""The server's chunked prefill against prefill in one forward, on dense and hybrid exports.

A prompt prefilled in chunks of ``--prefill-chunk`` tokens must leave the model where one forward over the
whole prompt leaves it: the same first-token logits to the bit (chunks of two or more tokens compute each
position as the whole prompt does; a lone last token takes the single-token path and rounds differently)
and the same greedy tokens after it (a recurrent state lost between chunks changes them all). Prompt
lengths are chosen so that cutting at multiples of the chunk would leave one token.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_helpers import INT8_ACTIVATIONS

from onnxgen import LLM, SamplingParams, load
from onnxgen.server.metrics import ServerMetrics
from onnxgen.server.scheduler import Scheduler, SchedulerConfig
from onnxgen.server.sequence import Delta, Handle, Job, SequenceRun

NEW_TOKENS = 12
PROMPT_LEN = 25  # 25 = 12 * 2 + 1 = 8 * 3 + 1 = 6 * 4 + 1 = 3 * 8 + 1 = 2 * 12 + 1 = 24 + 1
CHUNKS = [2, 3, 4, 8, 12, 24, 5, 7, PROMPT_LEN]  # the first six would leave a lone last token


def prompt_ids(llm: LLM) -> list[int]:
    vocab = llm.session.vocab_size
    return [int(5 + (7 * i) % (vocab - 10)) for i in range(PROMPT_LEN)]


class PrefillSpy:
    """Records what the scheduler's prefill forwards return (the decode steps run on the batch state)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lengths: list[int] = []
        self.last_logits: np.ndarray | None = None
        forward = llm.session.forward

        def spy(state: Any, ids: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
            out = forward(state, ids, *args, **kwargs)
            self.lengths.append(int(ids.shape[1]))
            self.last_logits = np.array(out[0, -1])
            return out

        monkeypatch.setattr(llm.session, "forward", spy)


def serve(llm: LLM, prompt: list[int], chunk: int) -> list[int]:
    """Greedy tokens of ``prompt`` through a scheduler that prefills ``chunk`` tokens at a time."""
    config = SchedulerConfig(max_batch=2, max_queue=1, max_model_len=64, prefill_chunk=chunk)
    scheduler = Scheduler(llm, config, ServerMetrics())
    deltas: list[Delta] = []
    done = threading.Event()

    def push(batch: list[Delta]) -> None:
        deltas.extend(batch)
        if any(d.finish_reason is not None for d in batch):
            done.set()

    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert llm.tokenizer is not None
    run = SequenceRun(0, prompt, params, llm.eos_token_ids, llm.tokenizer)
    scheduler.start()
    try:
        scheduler.submit([Job(Handle(push), prompt, [run])])
        assert done.wait(60), "the request did not finish"
    finally:
        scheduler.stop()
    assert all(d.error is None for d in deltas), deltas
    return [d.token_id for d in deltas]


@pytest.fixture(scope="module", params=["genai-dense", "hybrid-genai", "hybrid-mobius", INT8_ACTIVATIONS])
def llm(request: pytest.FixtureRequest, server_models: dict[str, Path]) -> Iterator[LLM]:
    yield load(server_models[request.param], threads=1)


@pytest.fixture(scope="module")
def unchunked(llm: LLM) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and first-token logits of the prompt prefilled in one forward."""
    with pytest.MonkeyPatch.context() as mp:
        spy = PrefillSpy(llm, mp)
        tokens = serve(llm, prompt_ids(llm), PROMPT_LEN)
    assert spy.lengths == [PROMPT_LEN] and spy.last_logits is not None
    return tokens, spy.last_logits


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_prefill_gives_the_first_logits_and_greedy_tokens_of_one_forward(
    llm: LLM, unchunked: tuple[list[int], np.ndarray], chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = PrefillSpy(llm, monkeypatch)
    tokens = serve(llm, prompt_ids(llm), chunk)
    assert sum(spy.lengths) == PROMPT_LEN and max(spy.lengths) <= max(chunk, 3)
    assert spy.last_logits is not None
    np.testing.assert_array_equal(spy.last_logits, unchunked[1])  # no chunk ran the single-token path
    assert tokens == unchunked[0]


def test_one_forward_prefill_in_the_server_gives_what_llm_generate_gives(
    llm: LLM, unchunked: tuple[list[int], np.ndarray], server_models: dict[str, Path]
) -> None:
    if llm.package.root == server_models[INT8_ACTIVATIONS]:
        pytest.skip("int8-activation kernels decode a lone row differently from the server's batch rows")
    alone = llm.generate(prompt_ids(llm), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert unchunked[0] == alone.token_ids


def test_a_corrupted_prefill_state_changes_the_tokens(
    llm: LLM, unchunked: tuple[list[int], np.ndarray]
) -> None:
    """The negative control: these comparisons see a prefill that lost what the first chunk left."""
    tail = prompt_ids(llm)[PROMPT_LEN // 2 :]
    assert serve(llm, tail, PROMPT_LEN) != unchunked[0]
