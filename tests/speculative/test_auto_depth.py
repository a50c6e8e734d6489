"""Auto with a chained drafter: the decision reads each draft depth's acceptance, on a tiny model with
scripted acceptance and fixed forward costs (so the decision depends on the drafts, not on timing noise)."""

from __future__ import annotations

import numpy as np
from speculative_helpers import PROMPT, ModelZoo, NoisyOracle, greedy

from onnxgen import SamplingParams
from onnxgen.generation.speculative.budget import DraftBudget
from onnxgen.generation.speculative.loop import SpeculativeLoop

N = 40


class FixedCosts(DraftBudget):
    """Plain steps cost 1, a verify of n tokens 1.3 + 0.2 (n - 2), a draft 0.3, whatever the clock says."""

    def observe_forward(self, tokens: int, seconds: float) -> None:
        super().observe_forward(tokens, 1.0 if tokens == 1 else 1.3 + 0.2 * (tokens - 2))

    def observe_proposal(self, tokens: int, seconds: float) -> None:
        super().observe_proposal(tokens, 0.3 * tokens)


class Chained(NoisyOracle):
    """Drafts plain greedy's tokens, the first one wrong on the proposals ``first_wrong`` marks (by
    proposal number modulo 5), every later one wrong except on proposals ``later_right`` marks."""

    def __init__(
        self, reference: list[int], vocab: int, first_wrong: set[int], later_right: set[int], chained: bool
    ) -> None:
        super().__init__(reference, 0.0, vocab)
        self.first_wrong, self.later_right, self.chained = first_wrong, later_right, chained
        self.calls = 0

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], None]:
        n, call = len(ids), self.calls % 5
        self.calls += 1
        drafts = []
        for i, t in enumerate(self.reference[n : n + k]):
            right = call not in self.first_wrong if i == 0 else call in self.later_right
            drafts.append(t if right else (t + 1) % self.vocab)
        return drafts, None


def run_auto(
    zoo: ModelZoo, first_wrong: set[int], later_right: set[int], chained: bool
) -> tuple[list[int], dict]:
    llm = zoo.llm("hybrid-genai")
    plain = greedy(llm, PROMPT, N).token_ids
    proposer = Chained([*PROMPT, *plain], llm.session.vocab_size, first_wrong, later_right, chained)
    state = llm.session.new_state(len(PROMPT) + N + 1)
    loop = SpeculativeLoop(
        llm.session, state, PROMPT, SamplingParams(max_new_tokens=N), (), proposer, 2, auto=True
    )
    assert loop.budget is not None and loop.budget.per_depth == chained
    loop.budget = FixedCosts(per_depth=chained)
    tokens = [t for t, _ in loop.tokens()]
    assert tokens == plain  # whatever auto decides
    return tokens, loop.stats()


def test_auto_keeps_drafting_where_the_first_draft_pays_though_the_second_rarely_passes(
    zoo: ModelZoo,
) -> None:
    # first draft right 4 times in 5 (1.8 tokens for 1.3 + 0.3 steps at one draft), the second 1 in 4
    _, stats = run_auto(zoo, first_wrong={2}, later_right={4}, chained=True)
    assert stats["speculation"] == "on", stats
    assert stats["accepted_draft_tokens"] > 10


def test_auto_stops_where_the_first_draft_does_not_pay(zoo: ModelZoo) -> None:
    # negative control: first draft right 2 times in 5 (1.4 tokens for 1.6 steps)
    _, stats = run_auto(zoo, first_wrong={0, 2, 3}, later_right=set(), chained=True)
    assert stats["speculation"].startswith("off after"), stats


def test_one_rate_for_every_depth_reads_the_same_head_as_losing(zoo: ModelZoo) -> None:
    # the first test's head, its rates pooled over depths (~0.56): predicted slower, drafting stops
    _, stats = run_auto(zoo, first_wrong={2}, later_right={4}, chained=False)
    assert stats["speculation"].startswith("off after"), stats
