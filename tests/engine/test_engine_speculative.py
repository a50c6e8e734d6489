"""Speculative sequences in the engine: each drafts and verifies in a lane of its own beside the batch's
plain rows, and gets the tokens ``LLM.generate`` gives the same request (greedy and seeded sampling; prompt
lookup on dense and hybrid exports, the bundled model's MTP head)."""

from __future__ import annotations

from pathlib import Path

import pytest

import onnxgen
from onnxgen import LLM, MTP, DraftModel, GenerationError, PromptLookup, SamplingParams
from onnxgen.engine.engine import Engine, RequestOutput
from onnxgen.runtime.state import DecodeState

LOOKUP = PromptLookup(num_draft_tokens=3)
# a fixed draft length: the adaptive one follows measured times, and so (with sampling) do the random
# draws a verify takes; greedy tokens never depend on it
FIXED = PromptLookup(num_draft_tokens=3, adaptive=False)


GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=14, temperature=0.8, top_k=50, seed=7, ignore_eos=True)


def drive(engine: Engine, requests: list[tuple[list[int], SamplingParams, object]]) -> list[list[int]]:
    """Queue every request at once and step until all finished; each one's tokens. Also asserts that
    lanes and batch rows ran in the same steps."""
    for i, (ids, params, speculative) in enumerate(requests):
        engine.add_request(i, ids, params, speculative)  # type: ignore[arg-type]
    tokens: list[list[int]] = [[] for _ in requests]
    mixed = False
    while engine.has_unfinished():
        outputs: list[RequestOutput] = engine.step()
        mixed |= bool(engine.scheduler.lanes and engine.scheduler.running)
        for out in outputs:
            assert out.finish_reason != "error", out.error
            tokens[int(out.request_id)].extend(out.token_ids)
    assert mixed, "no step ran lanes beside batch rows"
    return tokens


def test_speculative_and_plain_requests_share_steps_and_get_the_librarys_tokens(
    llm: LLM, prompts: list[list[int]]
) -> None:
    requests = [
        (prompts[0], GREEDY, LOOKUP),
        (prompts[1], GREEDY, None),
        (prompts[2], SEEDED, FIXED),
        (prompts[3], SEEDED, None),
    ]
    got = drive(llm.engine(), requests)
    accepted = 0
    for (ids, params, speculative), tokens in zip(requests, got, strict=True):
        want = llm.generate(ids, params, speculative=speculative)
        assert tokens == want.token_ids
        accepted += want.stats.get("accepted_draft_tokens", 0)
    assert accepted > 0  # the verifies accepted drafts: the commit path ran
    assert not llm.engine().scheduler.lanes and llm.engine().scheduler.free_rows == 4


def test_generate_a_list_with_speculation_equals_one_at_a_time(llm: LLM, prompts: list[list[int]]) -> None:
    proposed = 0
    for speculative, params in ((LOOKUP, GREEDY), (FIXED, SEEDED)):
        batched = llm.generate(prompts, params, speculative=speculative)
        for result, ids in zip(batched, prompts, strict=True):
            alone = llm.generate(ids, params, speculative=speculative)
            assert result.token_ids == alone.token_ids
            proposed += result.stats["proposed_draft_tokens"]
    assert proposed > 0


def test_lanes_sharing_one_state_would_be_caught(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: two lanes that decode on one decode state (instead of one each) get other tokens
    than the library gives them, so the equality above checks that each lane keeps its own state."""
    shared = llm.session.new_state(128)

    def one_state(capacity: int) -> DecodeState:
        shared.reset()
        return shared

    monkeypatch.setattr(llm.generator, "state_for", one_state)
    results = llm.generate(prompts[:2], GREEDY, speculative=LOOKUP)
    monkeypatch.undo()
    alone = [llm.generate(p, GREEDY, speculative=LOOKUP).token_ids for p in prompts[:2]]
    assert [r.token_ids for r in results] != alone


def test_draft_model_lanes_equal_the_library(llm: LLM, prompts: list[list[int]]) -> None:
    draft = DraftModel(str(llm.package.root), num_draft_tokens=3)  # the model drafts for itself
    batched = llm.generate(prompts[:2], GREEDY, speculative=draft)
    for result, ids in zip(batched, prompts[:2], strict=True):
        alone = llm.generate(ids, GREEDY, speculative=draft)
        assert result.token_ids == alone.token_ids
        assert result.stats["accepted_draft_tokens"] == result.stats["proposed_draft_tokens"] > 0


def test_an_aborted_lane_frees_its_row_and_the_others_go_on(llm: LLM, prompts: list[list[int]]) -> None:
    engine = llm.engine()
    engine.add_request("spec", prompts[0], GREEDY, LOOKUP)
    engine.add_request("plain", prompts[1], GREEDY)
    engine.step()
    assert len(engine.scheduler.lanes) == 1
    (out,) = engine.abort("spec")
    assert out.finish_reason == "abort"
    assert not engine.scheduler.lanes
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.token_ids]
    assert len(tokens) == GREEDY.max_new_tokens - 1 or len(tokens) == GREEDY.max_new_tokens
    assert engine.scheduler.free_rows == engine.limits.max_batch


def test_a_model_without_an_mtp_head_refuses_mtp_before_anything_runs(
    llm: LLM, prompts: list[list[int]]
) -> None:
    with pytest.raises(GenerationError, match="MTP"):
        llm.engine().add_request("m", prompts[0], GREEDY, MTP())
    assert not llm.engine().has_unfinished()


def test_mtp_requests_in_the_engine_equal_the_library(tmp_path: Path) -> None:
    llm = onnxgen.load(threads=1, max_batch=3, min_rows=1)  # the bundled model and its trained MTP head
    prompts = [llm.encode(text) for text in ("The cat sat on the", "Once upon a time", "1, 2, 3, 4,")]
    params = [GREEDY, SEEDED, GREEDY]
    speculative = MTP(num_draft_tokens=2, auto=False, adaptive=False)
    batched = llm.generate(prompts, params, speculative=speculative)
    proposed = 0
    for result, ids, p in zip(batched, prompts, params, strict=True):
        alone = llm.generate(ids, p, speculative=speculative)
        assert result.token_ids == alone.token_ids
        proposed += alone.stats["proposed_draft_tokens"]
    assert proposed > 0
