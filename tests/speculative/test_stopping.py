"""EOS ids, stop strings and max_new_tokens that fall inside an accepted run of drafts end generation at
exactly the token (and text) where plain decoding ends it."""

from __future__ import annotations

import pytest
from speculative_helpers import PROMPT, ModelZoo, assert_stats_consistent, greedy

from onnxgen import DraftModel, SamplingParams
from onnxgen.llm import LLM

FAMILIES = ("genai-dense", "hybrid-mobius")
N = 12
K = 4  # a self-draft's first verify emits tokens 1 .. K+1, all accepted: 2 .. K are inside the run
INSIDE_FIRST_RUN = range(2, K + 1)


def self_draft(llm: LLM) -> DraftModel:
    return DraftModel(llm, num_draft_tokens=K, adaptive=False)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("family", FAMILIES)
def test_max_new_tokens_inside_an_accepted_run_gives_exactly_plain_greedys_first_tokens(
    zoo: ModelZoo, family: str, max_new_tokens: int
) -> None:
    llm = zoo.llm(family)
    plain = greedy(llm, PROMPT, N).token_ids
    params = SamplingParams(max_new_tokens=max_new_tokens)
    result = llm.generate(PROMPT, params, speculative=self_draft(llm))
    assert result.token_ids == plain[:max_new_tokens]
    assert result.finish_reason == "length"
    assert result.stats["generated_tokens"] == max_new_tokens
    assert result.stats["accepted_draft_tokens"] == result.stats["proposed_draft_tokens"]
    if max_new_tokens == 7:  # prefill 1 token, a verify K + 1, then one left: a plain step, no drafts
        assert (result.stats["proposed_draft_tokens"], result.stats["target_forward_passes"]) == (K, 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_eos_token_inside_an_accepted_run_ends_generation_there_with_reason_stop(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    llm = zoo.llm(family)
    plain = greedy(llm, PROMPT, N).token_ids
    m = next(i for i in INSIDE_FIRST_RUN if plain[i] not in plain[:i])
    monkeypatch.setattr(llm.generator, "eos_ids", (plain[m],))
    params = SamplingParams(max_new_tokens=N)
    reference = llm.generate(PROMPT, params)
    result = llm.generate(PROMPT, params, speculative=self_draft(llm))
    assert reference.token_ids == result.token_ids == plain[: m + 1]
    assert reference.finish_reason == result.finish_reason == "stop"
    assert result.text == reference.text
    assert result.stats["accepted_draft_tokens"] == result.stats["proposed_draft_tokens"] == K
    assert_stats_consistent(result, hybrid=family.startswith("hybrid"))


def stop_string_inside_first_run(llm: LLM, plain_pieces: list[str]) -> tuple[str, int]:
    """A stop string that first occurs in the text where token m's text starts (m inside the first run)."""
    text = "".join(plain_pieces)
    for m in INSIDE_FIRST_RUN:
        start = len("".join(plain_pieces[:m]))
        piece = plain_pieces[m]
        if piece and text.find(piece) == start:
            return piece, start
    raise AssertionError(f"no token inside the first run has text that occurs first there: {plain_pieces}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stop_string_inside_an_accepted_run_ends_the_text_where_plain_decoding_ends_it(
    zoo: ModelZoo, family: str
) -> None:
    llm = zoo.llm(family)
    events = list(llm.stream(PROMPT, SamplingParams(max_new_tokens=N)))
    full = "".join(e.text for e in events)
    stop, start = stop_string_inside_first_run(llm, [e.text for e in events])
    params = SamplingParams(max_new_tokens=N, stop=stop)
    reference = llm.generate(PROMPT, params)
    result = llm.generate(PROMPT, params, speculative=self_draft(llm))
    assert reference.text == result.text == full[:start]
    assert reference.finish_reason == result.finish_reason == "stop"
    assert reference.token_ids == result.token_ids
    assert len(result.token_ids) <= K + 1  # it ended inside the first verify's run
    assert result.stats["accepted_draft_tokens"] == result.stats["proposed_draft_tokens"] == K


@pytest.mark.parametrize("family", FAMILIES)
def test_a_speculative_stream_yields_one_event_per_token_and_ends_with_the_finish_reason(
    zoo: ModelZoo, family: str
) -> None:
    llm = zoo.llm(family)
    plain = list(llm.stream(PROMPT, SamplingParams(max_new_tokens=N)))
    events = list(llm.stream(PROMPT, SamplingParams(max_new_tokens=N), speculative=self_draft(llm)))
    assert [e.token_ids for e in events] == [e.token_ids for e in plain]
    assert [e.text for e in events] == [e.text for e in plain]
    assert [e.finish_reason for e in events] == [None] * (N - 1) + ["length"]
    assert events[-1].stats is not None and events[-1].stats["accepted_draft_tokens"] > 0
