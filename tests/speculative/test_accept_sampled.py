"""accept_sampled on synthetic rows: the emitted token is distributed as the target's p, whatever q is.

Each case runs many seeded trials (pure numpy, no model) and compares the emitted-token counts with p
by Pearson's chi-square at alpha = 1e-3 (critical value: Wilson-Hilferty); the draws are seeded, so a
pass or fail is reproducible. A deliberately wrong acceptance rule on the same draws must fail.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
from speculative_helpers import chi2_critical, chi2_statistic

from onnxgen.generation.sampling import Sampler, probs
from onnxgen.generation.speculative.accept import accept_greedy, accept_greedy_lazily, accept_sampled

TRIALS = 6_000
P0 = np.array([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])  # token 5 masked (top-k / top-p)
P1 = np.array([0.05, 0.10, 0.40, 0.05, 0.00, 0.40])
Q0 = np.array([0.05, 0.40, 0.10, 0.30, 0.05, 0.10])  # mass where p is 0, and little where p is large
Q1 = np.array([0.30, 0.10, 0.10, 0.10, 0.30, 0.10])
BONUS = np.array([0.10, 0.20, 0.30, 0.40, 0.00, 0.00])

Accept = Callable[..., tuple[int, int]]


def logits(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p).astype(np.float32)


def run(
    rows: Sequence[np.ndarray],
    q: Sequence[np.ndarray] | None,
    fixed: Sequence[int] | None,
    seed: int,
    accept: Accept = accept_sampled,
    trials: int = TRIALS,
) -> list[list[int]]:
    """Emitted tokens of ``trials`` verify steps: drafts drawn from q (or the fixed drafts), then accept."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(seed + 1)
    target = [logits(r) for r in rows]
    if fixed is not None:
        draws = np.tile(np.asarray(fixed), (trials, 1))
    else:
        draws = np.stack([rng.choice(len(r), size=trials, p=r) for r in q or ()], axis=1)
    out = []
    for drafts in draws.tolist():
        j, token = accept(target, drafts, q, sampler)
        out.append([*drafts[:j], token])
    return out


def assert_distributed_as(samples: list[int], p: np.ndarray) -> None:
    counts = Counter(samples)
    assert all(p[t] > 0 for t in counts), f"emitted tokens outside p's support: {counts}"
    stat, df = chi2_statistic(counts, {t: float(x) for t, x in enumerate(p) if x > 0}, len(samples))
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} >= {chi2_critical(df):.1f} (df {df}): {counts}"


def test_with_a_general_draft_distribution_the_emitted_token_is_distributed_as_p() -> None:
    emitted = run([P0, BONUS], [Q0], None, seed=1)
    assert_distributed_as([e[0] for e in emitted], P0)
    accepted = sum(len(e) == 2 for e in emitted) / TRIALS
    expected = float(np.minimum(P0, Q0).sum())  # P(accept) = sum_x min(p(x), q(x))
    assert abs(accepted - expected) < 5 * np.sqrt(expected * (1 - expected) / TRIALS)


def test_with_two_drafts_the_second_emitted_token_is_distributed_as_the_second_row() -> None:
    emitted = run([P0, P1, BONUS], [Q0, Q1], None, seed=2)
    assert_distributed_as([e[0] for e in emitted], P0)
    seconds = [e[1] for e in emitted if len(e) >= 2]  # present when draft 0 was accepted
    assert len(seconds) > TRIALS // 10
    assert_distributed_as(seconds, P1)
    bonuses = [e[2] for e in emitted if len(e) == 3]
    assert len(bonuses) > 500
    assert_distributed_as(bonuses, BONUS)


def test_with_a_deterministic_draft_the_emitted_token_is_distributed_as_p() -> None:
    # Prompt lookup: q is one-hot at the draft, so the draft is accepted with probability p(draft).
    emitted = run([P0, BONUS], None, [1], seed=3)
    assert_distributed_as([e[0] for e in emitted], P0)
    accepted = sum(len(e) == 2 for e in emitted) / TRIALS
    assert abs(accepted - P0[1]) < 5 * np.sqrt(P0[1] * (1 - P0[1]) / TRIALS)


def test_a_deterministic_draft_outside_ps_support_is_never_accepted() -> None:
    emitted = run([P0, BONUS], None, [5], seed=4, trials=2000)
    assert all(len(e) == 1 for e in emitted)
    assert_distributed_as([e[0] for e in emitted], P0)


def test_a_draft_that_p_is_certain_of_is_always_accepted_and_the_bonus_is_drawn_from_the_last_row() -> None:
    certain = np.eye(6)[2]
    emitted = run([certain, BONUS], None, [2], seed=5)
    assert all(e[0] == 2 and len(e) == 2 for e in emitted)
    assert_distributed_as([e[1] for e in emitted], BONUS)


def test_when_p_equals_q_every_draft_is_accepted() -> None:
    p = probs(logits(P0))  # exactly the p accept_sampled computes, so p(x)/q(x) is exactly 1
    emitted = run([P0, BONUS], [p], None, seed=6, trials=1000)
    assert all(len(e) == 2 for e in emitted)


def test_the_chi_square_check_rejects_a_wrong_residual() -> None:
    # Negative control: resampling from p itself (instead of norm(max(0, p - q))) after a rejection is
    # a classic mistake; on the same draws the check must fail.
    def wrong(
        target: list[np.ndarray], drafts: list[int], q: list[np.ndarray], sampler: Sampler
    ) -> tuple[int, int]:
        p = probs(target[0])
        x = drafts[0]
        if sampler.uniform() < min(1.0, p[x] / q[0][x]):
            return 1, sampler.sample_probs(probs(target[1]))
        return 0, sampler.sample_probs(p)

    emitted = run([P0, BONUS], [Q0], None, seed=1, accept=wrong)
    counts = Counter(e[0] for e in emitted)
    stat, df = chi2_statistic(counts, dict(enumerate(P0[:5])), TRIALS)
    assert stat > 3 * chi2_critical(df)


def test_greedy_acceptance_keeps_the_longest_prefix_of_argmax_matches_then_the_targets_token() -> None:
    rows = [logits(P0), logits(P1), logits(BONUS)]  # argmaxes 0, 2 (lowest of the tied 2 and 5), 3
    assert accept_greedy(rows, [0, 2]) == (2, 3)
    assert accept_greedy(rows, [0, 5]) == (1, 2)
    assert accept_greedy(rows, [1, 2]) == (0, 0)
    assert accept_greedy(rows[:1], []) == (0, 0)


def test_lazy_greedy_acceptance_asks_for_no_position_past_the_first_mismatch() -> None:
    targets = [4, 7, 1, 9, 2]
    asked: list[int] = []

    def choose(i: int) -> int:
        asked.append(i)
        return targets[i]

    assert accept_greedy_lazily(choose, [4, 7, 5, 9]) == (2, 1)
    assert asked == [0, 1, 2]
    asked.clear()
    assert accept_greedy_lazily(choose, [4, 7, 1, 9]) == (4, 2)  # a full accept asks for the bonus position
    assert asked == [0, 1, 2, 3, 4]
