"""Adaptive draft length: doubled after a full accept (up to 3 k), one less after a rejection."""

from __future__ import annotations

import itertools

import numpy as np
from speculative_helpers import PROMPT, ModelZoo, NoisyOracle, greedy

from onnxgen import SamplingParams
from onnxgen.generation.speculative.loop import SpeculativeLoop, next_draft_length

K = 4
N = 40


def test_the_draft_length_doubles_after_full_accepts_and_shrinks_by_one_after_a_rejection() -> None:
    assert [next_draft_length(k, True, 12) for k in (1, 2, 4, 6, 8, 12)] == [3, 4, 8, 12, 12, 12]
    assert [next_draft_length(k, False, 12) for k in (1, 2, 8, 12)] == [1, 1, 7, 11]


class Perfect(NoisyOracle):
    """Drafts exactly plain greedy's next tokens, or wrong ones from position ``wrong_from`` on; records
    how many drafts each verify carried."""

    def __init__(self, reference: list[int], vocab: int, wrong_from: int = 10**9) -> None:
        super().__init__(reference, 0.0, vocab)
        self.wrong_from = wrong_from
        self.sizes: list[int] = []

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], None]:
        n = len(ids)
        drafts = [
            t if n + i < self.wrong_from else (t + 1) % self.vocab
            for i, t in enumerate(self.reference[n : n + k])
        ]
        self.sizes.append(len(drafts))
        return drafts, None


def test_a_loop_grows_its_drafts_to_three_times_k_on_full_accepts_and_keeps_plain_greedy_tokens(
    zoo: ModelZoo,
) -> None:
    llm = zoo.llm("hybrid-genai")
    plain = greedy(llm, PROMPT, N).token_ids
    reference = [*PROMPT, *plain]
    # drafts right for 30 generated tokens, then wrong: growth, then shrinking
    proposer = Perfect(reference, llm.session.vocab_size, wrong_from=len(PROMPT) + 30)
    state = llm.session.new_state(len(PROMPT) + N + 1)
    loop = SpeculativeLoop(
        llm.session, state, PROMPT, SamplingParams(max_new_tokens=N), (), proposer, K, adaptive=True
    )
    loop.budget = None  # the growth rule alone (the cost model caps it by measured times)
    tokens = [t for t, _ in loop.tokens()]
    assert tokens == plain
    sizes = proposer.sizes
    assert sizes[:3] == [4, 8, 12], sizes  # 1 + 4 + 1 + 8 + 1 + 12 + 1 = 28 tokens, all accepted
    assert max(sizes) == 3 * K
    assert loop.stats()["accepted_draft_tokens"] < loop.stats()["proposed_draft_tokens"]  # then rejections
    after = sizes[3:]
    assert after and all(b <= a for a, b in itertools.pairwise(after)), sizes  # shrinking
