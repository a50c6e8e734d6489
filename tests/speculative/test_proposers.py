"""Proposers on their own: n-gram prompt lookup, and the draft model's commit to the accepted prefix."""

from __future__ import annotations

import numpy as np
import pytest
from speculative_helpers import PROMPT, ModelZoo, fresh_state, mismatches

from onnxgen import SamplingParams
from onnxgen.generation.speculative.proposers import DraftModelProposer, NgramProposer
from onnxgen.runtime.session import DecoderSession

K = 4


def lookup(ids: list[int], k: int = K, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    drafts, q = NgramProposer(max_ngram, min_ngram).propose(np.asarray(ids, dtype=np.int64), k)
    assert q is None, "prompt lookup is deterministic: no draft probabilities"
    return drafts


def test_prompt_lookup_proposes_what_followed_the_longest_matching_ngram() -> None:
    # [8, 9] follows "1 2"; the bigram "7 1 2" ... trigram "7 1 2" occurs once, followed by 3 4 5 6.
    ids = [1, 2, 8, 9, 0, 7, 1, 2, 3, 4, 5, 6, 0, 7, 1, 2]
    assert lookup(ids) == [3, 4, 5, 6]


def test_prompt_lookup_prefers_the_latest_occurrence_of_an_ngram_of_the_same_length() -> None:
    assert lookup([5, 1, 2, 0, 5, 3, 4, 0, 5], k=2) == [3, 4]


def test_prompt_lookup_proposes_at_most_k_tokens_and_fewer_near_the_end() -> None:
    assert lookup([1, 2, 3, 4, 5, 6, 1], k=2) == [2, 3]
    assert lookup([9, 1, 2, 9], k=4) == [1, 2, 9]


def test_prompt_lookup_proposes_nothing_without_an_earlier_occurrence() -> None:
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([4]) == []


def test_prompt_lookup_honours_min_ngram() -> None:
    ids = [3, 1, 7, 7, 2, 1]  # only the unigram "1" recurs
    assert lookup(ids, min_ngram=1) == [7, 7, 2, 1]
    assert lookup(ids, min_ngram=2) == []


# -- draft model ------------------------------------------------------------------------------------
FAMILY = "hybrid-mobius"  # recurrent states: a commit must restore, it cannot truncate


def proposer(session: DecoderSession) -> DraftModelProposer:
    p = DraftModelProposer(session, SamplingParams(max_new_tokens=32), (), capacity=64)
    p.reset(len(PROMPT))
    return p


def greedy_continuation(session: DecoderSession, groups: list[list[int]], k: int) -> list[int]:
    """Feed ``groups`` (one forward each), then k greedy tokens by one-token steps."""
    state = session.new_state(64)
    for group in groups:
        logits = session.forward(state, np.asarray([group], dtype=np.int64), 1)[0, -1]
    tokens = [int(np.argmax(logits))]
    while len(tokens) < k:
        logits = session.forward(state, np.asarray([tokens[-1:]], dtype=np.int64), 1)[0, -1]
        tokens.append(int(np.argmax(logits)))
    return tokens


@pytest.mark.parametrize("j", [0, 1, 2, K])
def test_a_draft_model_commits_its_state_to_the_accepted_prefix_bit_for_bit(zoo: ModelZoo, j: int) -> None:
    session = zoo.llm(FAMILY).session
    draft = proposer(session)
    ids1 = [*PROMPT, 40]
    drafts1, q = draft.propose(np.asarray(ids1), K)
    assert len(drafts1) == K and q is None
    if j < K:  # the target rejected draft j and emitted its own token there
        kept, tail = drafts1[:j], [(drafts1[j] + 1) % 320]
        groups = [ids1, *[[d] for d in kept], tail]
    else:  # full accept, then the target's bonus token
        kept, tail = drafts1, [7]
        groups = [ids1, *[[d] for d in drafts1[: K - 1]], [drafts1[K - 1], *tail]]
    ids2 = [*ids1, *kept, *tail]
    drafts2, _ = draft.propose(np.asarray(ids2), K)
    fresh = fresh_state(session, [*groups, *[[d] for d in drafts2[: K - 1]]])
    assert draft.state.length == fresh.length == len(ids2) + K - 1
    assert not [*mismatches(draft.state.kv_arrays(), fresh.kv_arrays())]
    assert not [*mismatches(draft.state.state_arrays(), fresh.state_arrays())]
    assert drafts2 == greedy_continuation(session, groups, K)


def test_a_draft_model_continues_a_history_that_is_a_prefix_of_what_it_already_fed(zoo: ModelZoo) -> None:
    session = zoo.llm(FAMILY).session
    draft = proposer(session)
    ids1 = [*PROMPT, 40]
    drafts1, _ = draft.propose(np.asarray(ids1), K)
    # The target kept draft 0 and then emitted draft 1 itself (a sampled correction can equal the draft):
    # the new history ends inside what the draft already fed.
    ids2 = [*ids1, drafts1[0], drafts1[1]]
    drafts2, _ = draft.propose(np.asarray(ids2), K)
    assert drafts2[: K - 2] == drafts1[2:]


def test_speculative_off_is_a_mode_that_turns_speculation_off() -> None:
    from onnxgen.generation.speculative.spec import parse_speculative

    assert parse_speculative("off") is None
    assert parse_speculative("prompt-lookup") is not None
    with pytest.raises(ValueError, match="needs --speculative"):
        parse_speculative("off", 3)
