"""Speculative greedy decoding emits plain greedy's tokens on every export family, with every proposer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from speculative_helpers import (
    FAMILIES,
    HYBRID_FAMILIES,
    PROMPT,
    WEAK_DRAFT,
    ModelZoo,
    assert_same_as_plain,
    assert_stats_consistent,
    greedy,
    repeating_prompt,
)

from onnxgen import DraftModel, GenerationResult, PromptLookup, SamplingParams
from onnxgen.llm import LLM

N = 24


def count_forwards(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> Callable[[], int]:
    """Count the forwards run on ``llm``'s own session (independently of the loop's counters)."""
    calls = [0]
    for name in ("forward", "step"):
        inner = getattr(llm.session, name)

        def counted(*args: object, _inner: Callable[..., np.ndarray] = inner, **kwargs: object) -> np.ndarray:
            calls[0] += 1
            return _inner(*args, **kwargs)

        monkeypatch.setattr(llm.session, name, counted)
    return lambda: calls[0]


def speculate(
    llm: LLM, prompt: list[int], speculative: PromptLookup | DraftModel, **kw: object
) -> GenerationResult:
    return llm.generate(prompt, SamplingParams(max_new_tokens=N, **kw), speculative=speculative)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_greedy_emits_the_plain_greedy_tokens_and_accepts_repeated_spans(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    llm = zoo.llm(family)
    prompt = repeating_prompt(llm)
    plain = greedy(llm, prompt, N)
    forwards = count_forwards(monkeypatch, llm)
    result = speculate(llm, prompt, PromptLookup(num_draft_tokens=4))
    assert_same_as_plain(llm.session, prompt, plain.token_ids, result.token_ids)
    assert result.stats["accepted_draft_tokens"] > 0, "the repeated prompt was meant to make lookup accept"
    assert result.stats["target_forward_passes"] == forwards()
    assert_stats_consistent(result, hybrid=family.startswith("hybrid"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_self_draft_has_every_draft_accepted_and_emits_the_plain_greedy_tokens(
    zoo: ModelZoo, family: str
) -> None:
    llm = zoo.llm(family)
    plain = greedy(llm, PROMPT, N)
    result = speculate(llm, PROMPT, DraftModel(llm, num_draft_tokens=3))
    assert_same_as_plain(llm.session, PROMPT, plain.token_ids, result.token_ids)
    stats = result.stats
    assert stats["proposed_draft_tokens"] > 0
    assert stats["accepted_draft_tokens"] == stats["proposed_draft_tokens"]
    assert stats["state_replays"] == 0
    assert_stats_consistent(result, hybrid=family.startswith("hybrid"))
    assert stats["target_forward_passes"] <= N // 3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_weaker_int4_draft_has_drafts_both_accepted_and_rejected_and_emits_the_plain_greedy_tokens(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    llm = zoo.llm(family)
    draft = zoo.llm(WEAK_DRAFT[family], "int4")
    plain = greedy(llm, PROMPT, N)
    forwards = count_forwards(monkeypatch, llm)
    result = speculate(llm, PROMPT, DraftModel(draft, num_draft_tokens=4))
    assert_same_as_plain(llm.session, PROMPT, plain.token_ids, result.token_ids)
    stats = result.stats
    assert 0 < stats["accepted_draft_tokens"] < stats["proposed_draft_tokens"]
    assert stats["target_forward_passes"] == forwards()
    assert_stats_consistent(result, hybrid=family.startswith("hybrid"))


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_with_the_replay_commit_forced_a_weaker_draft_still_emits_the_plain_greedy_tokens(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    # Strategy (a) is the fallback of every verify plan: run it end to end, every partial accept replaying.
    llm = zoo.llm(family)
    monkeypatch.setattr(llm.session, "verify_plan", None, raising=False)
    plain = greedy(llm, PROMPT, N)
    # a fixed draft length: the timing-driven one may shorten drafts until replays cost more than accepts save
    draft = DraftModel(zoo.llm(WEAK_DRAFT[family], "int4"), num_draft_tokens=4, adaptive=False)
    result = speculate(llm, PROMPT, draft)
    assert_same_as_plain(llm.session, PROMPT, plain.token_ids, result.token_ids)
    stats = result.stats
    assert 0 < stats["accepted_draft_tokens"] < stats["proposed_draft_tokens"]
    assert stats["state_replays"] > 0
    assert_stats_consistent(result, hybrid=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_self_draft_sees_the_same_prompt_and_generated_split_as_the_target(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    # min_new_tokens masks eos while fewer tokens were generated: the first eligible step is decided
    # by where the prompt ends. A draft that counted the first generated token as prompt would mask
    # eos one step too long, propose another token there, and have it rejected.
    llm = zoo.llm(family)
    plain = greedy(llm, PROMPT, N).token_ids
    m = next(i for i in range(3, N) if plain[i] not in plain[:i])
    monkeypatch.setattr(llm.generator, "eos_ids", (plain[m],))
    params = SamplingParams(max_new_tokens=N, min_new_tokens=m, frequency_penalty=0.5)
    reference = llm.generate(PROMPT, params)
    assert reference.finish_reason == "stop" and len(reference.token_ids) == m + 1
    result = llm.generate(PROMPT, params, speculative=DraftModel(llm, num_draft_tokens=4))
    assert_same_as_plain(llm.session, PROMPT, reference.token_ids, result.token_ids)
    assert result.finish_reason == "stop"
    assert result.stats["accepted_draft_tokens"] == result.stats["proposed_draft_tokens"] > 0


def test_the_plain_comparison_fails_on_a_differing_token_that_is_not_a_near_tie(zoo: ModelZoo) -> None:
    # Negative control of assert_same_as_plain: a flip is excused only by a tiny top-2 margin.
    llm = zoo.llm("genai-dense")
    plain = greedy(llm, PROMPT, 8).token_ids
    flipped = [*plain[:3], (plain[3] + 1) % 320, *plain[4:]]
    with pytest.raises(AssertionError, match=r"top-2 logit margin there is .* not a near-tie"):
        assert_same_as_plain(llm.session, PROMPT, plain, flipped)
    with pytest.raises(AssertionError, match="different lengths"):
        assert_same_as_plain(llm.session, PROMPT, plain, plain[:-1])
