"""DraftBudget: the draft length a verify should carry, from forward costs and acceptance."""

from __future__ import annotations

import pytest

from onnxgen.generation.speculative.budget import STALE, DraftBudget


def budget_with(cost_per_extra_token: float, acceptance: float, verifies: int = 4, k: int = 8) -> DraftBudget:
    """A budget that timed one-token steps at 1 s, verifies of k + 1 tokens at 1 + k * slope, and saw
    ``verifies`` verifies whose drafts each passed with probability ``acceptance`` given that the ones
    before them passed: every draft accepted (1.0), or j accepted and the next one rejected, with
    j / (j + 1) = acceptance (the drafts proposed past the miss do not count)."""
    b = DraftBudget()
    b.observe_forward(1, 1.0)
    b.observe_forward(k + 1, 1.0 + k * cost_per_extra_token)
    accepted = k if acceptance == 1.0 else round(acceptance / (1.0 - acceptance))
    assert acceptance == 1.0 or accepted / (accepted + 1) == pytest.approx(acceptance)
    for _ in range(verifies):
        b.observe_verify(max(k, accepted + 3) if acceptance < 1.0 else k, accepted)
    return b


def brute_force(k: int, slope: float, rate: float) -> int:
    values = {n: sum(rate**i for i in range(n + 1)) / (1 + n * slope) for n in range(1, k + 1)}
    best = max(values, key=values.__getitem__)
    return best


def test_the_budget_abstains_until_it_has_timed_both_kinds_of_forward_and_seen_verifies() -> None:
    b = DraftBudget()
    assert b.cap(6) == 6
    b.observe_forward(1, 1.0)
    b.observe_verify(4, 2)
    assert b.cap(6) == 6  # no multi-token forward timed, one verify seen
    b.observe_forward(5, 2.0)
    assert b.cap(6) == 6  # one verify is not enough
    b.observe_verify(4, 2)
    assert b.cap(6) != 6


def test_the_cap_maximises_expected_tokens_per_unit_of_time() -> None:
    for slope, rate in ((0.05, 0.9), (0.25, 0.75), (0.5, 0.5), (0.1, 0.5), (0.3, 0.875)):
        b = budget_with(slope, rate)
        assert b.cap(8) == brute_force(8, slope, rate), (slope, rate)


def test_cheap_verifies_and_high_acceptance_keep_every_draft() -> None:
    assert budget_with(0.02, 1.0).cap(8) == 8


def test_when_no_draft_pays_it_still_verifies_one() -> None:
    """Declining is the loop's back-off; one draft keeps the acceptance estimate current."""
    assert budget_with(1.0, 0.5).cap(8) == 1


def test_drafts_proposed_past_the_first_miss_do_not_lower_the_acceptance_rate() -> None:
    """A verify that missed at its second draft says the same about the next verify's first drafts
    whether it carried 2 drafts or 12: counting the untested ones as failures would read 12 drafts with
    one accepted as a 1-in-12 rate and hold the drafts at one after every long verify that missed early."""
    caps = []
    for proposed in (2, 8, 12):
        b = DraftBudget()
        b.observe_forward(1, 1.0)
        b.observe_forward(9, 1.0 + 8 * 0.05)
        for _ in range(4):
            b.observe_verify(proposed, 1)
        caps.append(b.cap(8))
    assert caps[0] == caps[1] == caps[2] == brute_force(8, 0.05, 0.5)


def test_costs_between_measured_counts_are_interpolated() -> None:
    b = DraftBudget()
    b.observe_forward(1, 1.0)
    b.observe_forward(9, 3.0)
    assert b.cost(5) == 2.0 and b.cost(9) == 3.0 and b.cost(1) == 1.0
    assert DraftBudget().cost(3) is None


def test_a_costly_proposer_shortens_the_drafts() -> None:
    cheap = budget_with(0.1, 0.75)
    costly = budget_with(0.1, 0.75)
    for _ in range(20):
        costly.observe_proposal(4, 4 * 0.3)  # each draft token costs 0.3 steps
    assert costly.cap(8) < cheap.cap(8)


def test_acceptance_after_a_full_accept_is_kept_apart_from_acceptance_after_a_miss() -> None:
    """Inside a copied span drafts keep passing; after a miss they mostly fail: the cap follows the run."""
    b = DraftBudget()
    b.observe_forward(1, 1.0)
    b.observe_forward(9, 1.0 + 8 * 0.25)
    for _ in range(3):  # runs of five full accepts, then runs of five verifies that accept nothing
        for accepted in (8,) * 5 + (0,) * 5:
            b.observe_verify(8, accepted)
    after_miss = b.cap(8)
    b.observe_verify(8, 8)  # now after a full accept
    assert after_miss == 1 and b.cap(8) > 1


def test_a_verify_size_timed_once_while_slow_is_forgotten_once_other_sizes_are_timed() -> None:
    """Only chosen sizes are timed again: a size that was slow once (the first forward of that size, a
    busy moment) must not keep the cap below it for the rest of the request."""
    b = DraftBudget()
    b.observe_forward(1, 1.0)
    b.observe_forward(9, 20.0)  # one slow 9-token verify
    for _ in range(4):
        b.observe_verify(8, 8)
    b.observe_forward(2, 1.1)
    assert b.cost(9) == 20.0 and b.cap(8) < 8  # fresh: it counts
    for _ in range(STALE):
        b.observe_forward(2, 1.1)  # cheap 2-token verifies, all accepted
    assert b.cost(9) == pytest.approx(1.0 + 8 * 0.1)  # read off the fresh 2-token cost
    assert b.cap(8) == 8
    b.observe_forward(9, 1.5)  # timed again: starts over, not blended with the forgotten 20 s
    assert b.cost(9) == 1.5


def test_the_predicted_speedup_is_above_one_only_where_accepted_drafts_pay_for_the_verify() -> None:
    # Verifies of k + 1 tokens cost 1 + 0.1 k plain steps; drafting costs 0.3 of a step per draft (an MTP
    # head): all drafts accepted give ~2x, none accepted give 1 / (1.1 + 0.3) at one draft.
    for acceptance, low, high in ((1.0, 1.5, 2.5), (0.0, 0.0, 0.75)):
        b = budget_with(0.1, acceptance, k=3)
        for _ in range(3):
            b.observe_proposal(3, 0.9)
        gain = b.gain(3)
        assert gain is not None and low < gain < high, (acceptance, gain)
    assert DraftBudget().gain(3) is None  # nothing measured: no prediction


def test_a_plain_step_time_given_apart_rescales_the_predicted_speedup() -> None:
    # The one-token forwards timed while speculating hand an MTP head its hidden state off the decode lane;
    # plain decoding's steps (the lane) are cheaper, and the prediction must be made against them.
    b = budget_with(0.1, 0.5, k=3)
    alone = b.gain(3)
    assert alone is not None
    assert b.gain(3, plain=0.5) == pytest.approx(alone * 0.5)  # plain steps twice as fast as those timed
    assert b.gain(3, plain=None) == alone


def chained_budget(
    per_depth: bool, pattern: list[int], verify: tuple[float, float], draft: float
) -> DraftBudget:
    """A budget that timed one-token steps at 1 s, verifies of 2 and 3 tokens at ``verify``, drafts at
    ``draft`` s each, and saw verifies of 2 drafts accepting ``pattern`` (repeated), as a chained drafter
    whose second draft passes less often than its first."""
    b = DraftBudget(per_depth=per_depth)
    b.observe_forward(1, 1.0)
    b.observe_forward(2, verify[0])
    b.observe_forward(3, verify[1])
    for _ in range(4):
        for accepted in pattern:
            b.observe_proposal(2, 2 * draft)
            b.observe_verify(2, accepted)
    return b


# per 10 verifies of 2 drafts: the first draft passes 9 times, the second 1 time in those 9
STEEP = [1, 1, 1, 1, 0, 1, 1, 1, 1, 2]
# per 5: the first passes 4 times, the second 1 time in those 4
FALLING = [1, 1, 0, 1, 2]


def test_a_chained_drafter_whose_second_draft_rarely_passes_drafts_one() -> None:
    """One rate for both depths (~0.5) reads the second draft as paying; the rate per depth (~0.9, ~0.1)
    does not. A drafter whose drafts pass at one rate at every depth is capped as before."""
    per_depth = chained_budget(True, STEEP, (1.1, 1.2), 0.1)
    pooled = chained_budget(False, STEEP, (1.1, 1.2), 0.1)
    assert per_depth.cap(2) == 1
    assert pooled.cap(2) == 2
    flat = [2, 2, 2, 0, 2]  # the second draft passes whenever the first did: no fall with depth
    assert chained_budget(True, flat, (1.1, 1.2), 0.1).cap(2) == chained_budget(
        False, flat, (1.1, 1.2), 0.1
    ).cap(2)


def test_auto_keeps_a_chained_drafter_whose_first_draft_pays_and_stops_one_whose_first_draft_does_not() -> (
    None
):
    """Verifies of one draft cost 1.3 steps and a draft 0.3: a first draft accepted ~80% of the time pays
    (1.8 tokens for 1.6 steps) though the pooled rate over both depths (~0.56) predicts a loss."""
    keep = chained_budget(True, FALLING, (1.3, 1.5), 0.3)
    gain = keep.gain(2)
    assert gain is not None and gain > 1.0 and keep.cap(2) == 1
    pooled = chained_budget(False, FALLING, (1.3, 1.5), 0.3).gain(2)
    assert pooled is not None and pooled < 1.0
    # negative control: the same head with its first draft at ~40% loses whatever the depth model
    weak = [0, 1, 0, 0, 1]
    stop = chained_budget(True, weak, (1.3, 1.5), 0.3).gain(2)
    assert stop is not None and stop < 1.0
