"""The engine: ``LLM.generate(list)`` decodes prompts as a continuous batch and each gets what it gets alone;
the scheduler's chunked prefill, retirement and abort.

Rows join as others finish (``max_batch`` below the number of prompts), prompts prefill in chunks of a few
tokens between decode steps, and greedy rows share the batch with seeded sampled ones. fp32 exports are
compared with the plain single-sequence path (``LLM.generate(prompt)``, the fast lane); the int4 export
on int8 activations, whose kernels compute a lone row differently from a block, with each prompt alone
through the engine (padded to ``min_rows`` as the batch is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen import LLM, GenerationError, SamplingParams
from onnxgen.engine.engine import Engine
from onnxgen.engine.limits import BatchLimits
from onnxgen.runtime.batch import BatchState
from onnxgen.testing import build_model, int8_activations

LENGTHS = (1, 3, 7, 12, 9, 5)


def prompt(k: int, length: int) -> list[int]:
    return [(37 * i + 11 * k) % 300 + 3 for i in range(length)]


PROMPTS = [prompt(k, n) for k, n in enumerate(LENGTHS)]
PARAMS = [
    SamplingParams(max_new_tokens=10 + k, ignore_eos=True)
    if k % 2 == 0
    else SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, seed=k, ignore_eos=True)
    for k in range(len(LENGTHS))
]


def int8_activation_model(root: Path) -> Path:
    """The tiny dense int4 export with its MatMulNBits on int8 activations (accuracy_level 4)."""
    return int8_activations(build_model(root, "genai-dense", precision="int4"))


@pytest.fixture(scope="module", params=["genai-dense", "hybrid-genai", "int8-activations"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    root = tmp_path_factory.mktemp(request.param)
    model = (
        int8_activation_model(root)
        if request.param == "int8-activations"
        else build_model(root, request.param)
    )
    # 3 rows for 6 prompts: rows are retired and reused; prompts prefill 4 tokens a step
    return onnxgen.load(model, threads=1, max_batch=3, prefill_chunk=4)


def alone(llm: LLM, p: list[int], params: SamplingParams) -> list[int]:
    if llm.engine().limits.min_rows > 1:  # a lone row on the lane may round apart: the engine, alone
        return llm.generate([p], params)[0].token_ids
    return llm.generate(p, params).token_ids


def test_a_list_of_prompts_decodes_as_a_batch_with_each_prompts_tokens_alone(llm: LLM) -> None:
    batched = llm.generate(PROMPTS, PARAMS)
    assert [len(r.token_ids) for r in batched] == [p.max_new_tokens for p in PARAMS]
    assert all(r.finish_reason == "length" for r in batched)
    for result, p, params in zip(batched, PROMPTS, PARAMS, strict=True):
        assert result.token_ids == alone(llm, p, params)
    assert not llm.engine().has_unfinished() and llm.engine().scheduler.batch.n == 0


def test_mixed_up_rows_would_be_caught(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a batch that hands rows each other's logits changes the tokens."""
    step = BatchState.step

    def swapped(self: BatchState, tokens: list[int]) -> np.ndarray:
        return step(self, tokens)[::-1].copy()

    want = llm.generate(PROMPTS[:3], PARAMS[0])
    monkeypatch.setattr(BatchState, "step", swapped)
    assert [r.token_ids for r in llm.generate(PROMPTS[:3], PARAMS[0])] != [r.token_ids for r in want]


def test_one_params_for_all_prompts_and_text_prompts(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    texts = ["hello there", "a b c"] if llm.tokenizer is not None else []
    prompts: list[str | list[int]] = [PROMPTS[2], *texts]
    got = llm.generate(prompts, params)
    assert len(got) == len(prompts)
    for result, p in zip(got, prompts, strict=True):
        want = llm.generate(p, params)
        assert result.token_ids == want.token_ids and result.text == want.text


def test_bad_requests_are_refused_before_any_runs(llm: LLM) -> None:
    with pytest.raises(GenerationError, match="prompt token ids"):
        llm.generate([PROMPTS[0], [10**9]], SamplingParams(max_new_tokens=2))
    assert not llm.engine().has_unfinished()
    with pytest.raises(GenerationError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], PARAMS[:2])
    with pytest.raises(GenerationError, match="MTP speculation needs the model's MTP head"):
        llm.generate(PROMPTS[:2], speculative=onnxgen.MTP())  # (these tiny models have none)
    assert not llm.engine().has_unfinished()


# -- the scheduler ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return onnxgen.load(build_model(tmp_path_factory.mktemp("dense"), "genai-dense"), threads=1)


def test_prefill_chunks_never_leave_a_lone_last_token(dense: LLM) -> None:
    def cuts(chunk: int, length: int) -> list[int]:
        engine = Engine(dense.generator, BatchLimits(prefill_chunk=chunk, max_model_len=64))
        out, left = [], length
        while left:
            out.append(engine.scheduler.chunk(left))
            left -= out[-1]
        return out

    assert cuts(4, 12) == [4, 4, 4]
    assert cuts(4, 10) == [4, 4, 2]
    assert cuts(4, 9) == [4, 3, 2]  # not [4, 4, 1]
    assert cuts(2, 5) == [2, 3]  # chunks of 2: the last takes 3
    assert cuts(4, 1) == [1]  # a one-token prompt is one token


def test_chunked_prefill_interleaves_with_decoding_and_keeps_the_tokens(dense: LLM) -> None:
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = Engine(dense.generator, BatchLimits(max_batch=2, prefill_chunk=4, max_model_len=64))
    engine.add_request("short", PROMPTS[1], params)  # 3 tokens: prefilled and decoding after one step
    engine.add_request("long", PROMPTS[3], params)  # 12 tokens: 4 a step
    got: dict[str, list[int]] = {"short": [], "long": []}
    steps: list[set[str]] = []
    while engine.has_unfinished():
        outs = engine.step()
        steps.append({str(o.request_id) for o in outs})
        for o in outs:
            got[str(o.request_id)].extend(o.token_ids)
    # "long" prefills over three steps (4 tokens each) while "short" decodes: the first two give only
    # "short" tokens
    assert steps[0] == {"short"} and steps[1] == {"short"} and steps[2] == {"short", "long"}
    assert got["short"] == dense.generate(PROMPTS[1], params).token_ids
    assert got["long"] == dense.generate(PROMPTS[3], params).token_ids


def test_abort_frees_the_row_wherever_the_request_is_and_the_others_go_on(dense: LLM) -> None:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = Engine(dense.generator, BatchLimits(max_batch=2, prefill_chunk=4, max_model_len=64))
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(i, p, params)
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    for out in engine.step() + engine.step():
        got[int(out.request_id)].extend(out.token_ids)
    scheduler = engine.scheduler
    assert scheduler.batch.n == 2 and len(scheduler.waiting) + (scheduler.prefilling is not None) == 2
    (running,) = engine.abort(1)  # a running row
    assert running.finish_reason == "abort" and running.request_id == 1 and scheduler.batch.n == 1
    (waiting,) = engine.abort(3)  # still queued
    assert waiting.finish_reason == "abort" and engine.abort(3) == []
    finished: dict[int, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[int(out.request_id)].extend(out.token_ids)
            finished[int(out.request_id)] = out.finish_reason
    assert finished == {0: "length", 2: "length"} and scheduler.batch.n == 0
    for i in (0, 2):
        assert got[i] == dense.generate(PROMPTS[i], params).token_ids
    with pytest.raises(GenerationError, match="already running"):
        engine.add_request(5, PROMPTS[0], params)
        engine.add_request(5, PROMPTS[0], params)


def test_the_choices_of_one_request_prefill_once_and_each_decode_as_alone(
    dense: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    choices = [
        SamplingParams(max_new_tokens=8, temperature=0.9, seed=seed, ignore_eos=True) for seed in (1, 2, 3)
    ]
    engine = Engine(dense.generator, BatchLimits(max_batch=3, prefill_chunk=16, max_model_len=64))
    widths: list[int] = []
    forward = dense.session.forward

    def spy(state: Any, ids: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        widths.append(int(ids.shape[1]))
        return forward(state, ids, *args, **kwargs)

    monkeypatch.setattr(dense.session, "forward", spy)
    engine.add_request("r", PROMPTS[3], choices)
    with pytest.raises(GenerationError, match="4 sequences of one prompt exceed the batch of 3 rows"):
        engine.add_request("too many", PROMPTS[3], [*choices, choices[0]])
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.index].extend(out.token_ids)
    monkeypatch.undo()
    assert widths == [len(PROMPTS[3])]  # one prefill forward for the three choices
    assert len({tuple(ids) for ids in got.values()}) == 3  # their seeds differ
    for index, params in enumerate(choices):
        assert got[index] == dense.generate(PROMPTS[3], params).token_ids


def test_abort_mid_prefill_drops_the_partial_prompt_and_the_next_one_prefills_from_scratch(
    dense: LLM,
) -> None:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine(dense.generator, BatchLimits(max_batch=2, prefill_chunk=4, max_model_len=64))
    engine.add_request("long", PROMPTS[3], params)  # 12 tokens: 4 a step
    engine.add_request("next", PROMPTS[4], params)
    assert engine.step() == []  # 4 of 12 prefilled
    scheduler = engine.scheduler
    assert scheduler.prefilling is not None and scheduler.prefilling[0].offset == 4
    (out,) = engine.abort("long")
    assert out.finish_reason == "abort" and scheduler.prefilling is None
    got: list[int] = []
    while engine.has_unfinished():
        got += [t for o in engine.step() for t in o.token_ids]
    # the half-prefilled state was reset: "next" decodes as alone
    assert got == dense.generate(PROMPTS[4], params).token_ids
    assert scheduler.batch.n == 0 and scheduler.free_rows == 2


def test_a_retired_row_is_refilled_by_the_last_row_which_decodes_on(dense: LLM) -> None:
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    long = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine = Engine(dense.generator, BatchLimits(max_batch=3, prefill_chunk=16, max_model_len=64))
    for name, p, params in (("a", PROMPTS[0], short), ("b", PROMPTS[1], long), ("c", PROMPTS[2], long)):
        engine.add_request(name, p, params)
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    slots: list[dict[str, int | None]] = []
    while engine.has_unfinished():
        for out in engine.step():
            got[str(out.request_id)] += out.token_ids
        slots.append({name: seq.slot for name in "bc" for seq in engine.sequences(name)})
    # "a" held row 0 and finished first: the last row ("c", row 2) moved into it
    assert {"b": 1, "c": 0} in slots
    assert got["b"] == dense.generate(PROMPTS[1], long).token_ids
    assert got["c"] == dense.generate(PROMPTS[2], long).token_ids
