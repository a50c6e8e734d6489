from __future__ import annotations

import numpy as np
import pytest

from onnxgen.generation.params import SamplingParams
from onnxgen.generation.processors import (
    FrequencyPenalty,
    MinNewTokens,
    MinP,
    PresencePenalty,
    RepetitionPenalty,
    SequenceView,
    Temperature,
    TokenChoice,
    TopK,
    TopP,
    apply_chain,
    build_chain,
    choose,
)

NEG_INF = -np.inf
LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -4.0], dtype=np.float32)


def view(prompt: list[int], generated: list[int]) -> SequenceView:
    return SequenceView(np.array(prompt + generated, dtype=np.int64), len(prompt))


def f32(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_every_seen_id() -> None:
    out = RepetitionPenalty(2.0)(view([0, 1], [1]), LOGITS)
    # id 0: 2.0 / 2; id 1 (seen twice, penalised once): -1.0 * 2; others untouched.
    np.testing.assert_array_equal(out, f32([1.0, -2.0, 0.5, 3.0, -4.0]))
    assert out.dtype == np.float32


def test_presence_penalty_counts_generated_tokens_only_and_once_per_id() -> None:
    out = PresencePenalty(0.5)(view([3, 3], [0, 0, 2]), LOGITS)
    np.testing.assert_array_equal(out, f32([1.5, -1.0, 0.0, 3.0, -4.0]))


def test_a_negative_presence_penalty_raises_the_logits() -> None:
    out = PresencePenalty(-1.0)(view([], [4]), LOGITS)
    np.testing.assert_array_equal(out, f32([2.0, -1.0, 0.5, 3.0, -3.0]))


def test_frequency_penalty_scales_with_the_count_in_generated_tokens() -> None:
    out = FrequencyPenalty(0.25)(view([3, 3], [0, 0, 2]), LOGITS)
    np.testing.assert_array_equal(out, f32([1.5, -1.0, 0.25, 3.0, -4.0]))


def test_min_new_tokens_masks_eos_until_enough_tokens_were_generated() -> None:
    processor = MinNewTokens(2, eos_ids=[4, 3])
    early = processor(view([0, 1], [2]), LOGITS)
    np.testing.assert_array_equal(early, f32([2.0, -1.0, 0.5, NEG_INF, NEG_INF]))
    late = processor(view([0, 1], [2, 2]), LOGITS)
    np.testing.assert_array_equal(late, LOGITS)


def test_greedy_choose_under_min_new_tokens_is_the_argmax_of_the_masked_logits_without_masking_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """choose() takes the raw argmax when it is not an eos id still held back, and masks only when it is;
    the token equals the masked argmax either way, exact ties included (the lowest id wins)."""
    calls = []
    call = MinNewTokens.__call__
    monkeypatch.setattr(MinNewTokens, "__call__", lambda self, seq, x: calls.append(1) or call(self, seq, x))
    chain = build_chain(SamplingParams(min_new_tokens=3), [4, 1])
    rng = np.random.default_rng(5)
    masked_runs = 0
    for case in range(300):
        logits = rng.standard_normal(6).astype(np.float32).round(1)  # rounding makes ties common
        if case % 4 == 0:
            logits[rng.choice([1, 4])] = logits.max() + 1.0  # an eos id is the raw argmax
        if case % 7 == 0:  # an eos id ties with the best other id, below or above it
            logits[[1, 2]] = logits[[4, 5]] = logits.max() + 0.5
        generated = [0] * (case % 5)  # min_new_tokens=3: eos held back for 0-2 tokens, then not
        ids = np.array([3, 3, *generated], dtype=np.int64)
        expected = int(np.argmax(apply_chain(chain, SequenceView(ids, 2), logits)))
        calls.clear()
        assert choose(chain, None, ids, 2, logits) == expected, case
        raw = int(np.argmax(logits))
        if raw in (1, 4) and len(generated) < 3:
            assert calls and expected not in (1, 4)
            masked_runs += 1
        else:  # the row was not masked (nor copied)
            assert not calls and expected == raw
    assert masked_runs > 20


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(min_new_tokens=3),
        SamplingParams(min_new_tokens=3, presence_penalty=0.7),
    ],
    ids=["empty chain", "min_new_tokens", "with a penalty"],
)
def test_greedy_choice_resolved_once_equals_the_argmax_of_the_whole_chain(params: SamplingParams) -> None:
    """TokenChoice answers with one set lookup where the chain only masks ids it declared (eos here),
    and through choose() otherwise; the token is always the processed argmax, exact ties included."""
    chain = build_chain(params, [4, 1])
    greedy = TokenChoice(chain, None)
    assert (greedy.maskable is None) == (params.presence_penalty != 0.0)
    rng = np.random.default_rng(9)
    eos_argmax = 0
    for case in range(300):
        logits = rng.standard_normal(6).astype(np.float32).round(1)
        if case % 3 == 0:
            logits[rng.choice([1, 4])] = logits.max() + 1.0  # an eos id is the raw argmax
            eos_argmax += 1
        if case % 7 == 0:
            logits[[1, 2]] = logits[[4, 5]] = logits.max() + 0.5  # eos ids tie with other ids
        ids = np.array([3, 3, *[0, 2, 5][: case % 4]], dtype=np.int64)  # 0-3 generated tokens
        expected = int(np.argmax(apply_chain(chain, SequenceView(ids, 2), logits)))
        assert greedy(ids, 2, logits) == expected, case
    assert eos_argmax > 50


def test_temperature_divides_the_logits() -> None:
    out = Temperature(0.5)(view([], []), f32([1.0, -2.0, 0.25]))
    np.testing.assert_array_equal(out, f32([2.0, -4.0, 0.5]))
    assert out.dtype == np.float32


def test_top_k_keeps_the_k_largest_logits() -> None:
    out = TopK(2)(view([], []), f32([1.0, 3.0, 2.0, 0.5]))
    np.testing.assert_array_equal(out, f32([NEG_INF, 3.0, 2.0, NEG_INF]))


def test_top_k_keeps_every_logit_tied_with_the_kth() -> None:
    out = TopK(2)(view([], []), f32([1.0, 3.0, 2.0, 2.0]))
    np.testing.assert_array_equal(out, f32([NEG_INF, 3.0, 2.0, 2.0]))


def test_top_k_at_least_the_vocabulary_changes_nothing() -> None:
    np.testing.assert_array_equal(TopK(5)(view([], []), LOGITS), LOGITS)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, [1]), (0.7, [1, 3]), (0.85, [1, 3, 0]), (0.99, [1, 3, 0, 2])],
)
def test_top_p_keeps_the_smallest_set_of_likely_tokens_reaching_top_p(top_p: float, kept: list[int]) -> None:
    # probabilities 0.15, 0.5, 0.05, 0.3: the mass before each token (most likely first) is
    # id1: 0, id3: 0.5, id0: 0.8, id2: 0.95; a token is kept while that mass is below top_p.
    logits = np.log(f32([0.15, 0.5, 0.05, 0.3]))
    out = TopP(top_p)(view([], []), logits)
    expected = np.full(4, NEG_INF, dtype=np.float32)
    expected[kept] = logits[kept]
    np.testing.assert_array_equal(out, expected)


def test_top_p_always_keeps_the_most_likely_token() -> None:
    out = TopP(0.01)(view([], []), f32([0.0, 5.0, 1.0]))
    np.testing.assert_array_equal(out, f32([NEG_INF, 5.0, NEG_INF]))


def test_top_p_on_equal_probabilities_keeps_the_lowest_ids_and_grows_its_sorted_head() -> None:
    # 1000 equal tokens: the mass before the i-th is i/1000, below 0.5005 for i = 0..500.
    out = TopP(0.5005, initial_head=4)(view([], []), np.zeros(1000, dtype=np.float32))
    assert np.array_equal(np.flatnonzero(out == 0.0), np.arange(501))
    assert np.all(out[501:] == NEG_INF)


def hf_style_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Reference: full ascending sort, drop tokens whose cumulative probability is <= 1 - top_p."""
    order = np.argsort(logits, kind="stable")
    sorted_probs = np.exp(logits[order].astype(np.float64) - logits.max())
    cumulative = np.cumsum(sorted_probs / sorted_probs.sum())
    remove = cumulative <= 1 - top_p
    remove[-1] = False
    out = logits.copy()
    out[order[remove]] = NEG_INF
    return out


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_matches_a_full_sort_on_random_logits(top_p: float) -> None:
    logits = (np.random.default_rng(7).standard_normal(5000) * 4).astype(np.float32)
    np.testing.assert_array_equal(TopP(top_p)(view([], []), logits), hf_style_top_p(logits, top_p))


def test_min_p_masks_tokens_below_min_p_times_the_top_probability() -> None:
    # threshold 0.1 * 0.5 = 0.05: only the 0.04 token falls below it.
    logits = np.log(f32([0.5, 0.3, 0.04, 0.16]))
    out = MinP(0.1)(view([], []), logits)
    np.testing.assert_array_equal(out, np.array([logits[0], logits[1], NEG_INF, logits[3]], dtype=np.float32))


def test_processors_leave_their_input_untouched() -> None:
    seq = view([0, 1], [2, 3])
    for processor in [
        RepetitionPenalty(1.5),
        PresencePenalty(1.0),
        FrequencyPenalty(1.0),
        MinNewTokens(9, [4]),
        Temperature(2.0),
        TopK(1),
        TopP(0.5),
        MinP(0.5),
    ]:
        logits = LOGITS.copy()
        processor(seq, logits)
        np.testing.assert_array_equal(logits, LOGITS, err_msg=type(processor).__name__)


def test_a_batch_of_rows_gets_each_rows_own_history() -> None:
    batch = np.stack([LOGITS, LOGITS])
    seqs = [view([0], [1]), view([], [3, 3])]
    rep = RepetitionPenalty(2.0)(seqs, batch)
    np.testing.assert_array_equal(rep[0], f32([1.0, -2.0, 0.5, 3.0, -4.0]))
    np.testing.assert_array_equal(rep[1], f32([2.0, -1.0, 0.5, 1.5, -4.0]))
    freq = FrequencyPenalty(1.0)(seqs, batch)
    np.testing.assert_array_equal(freq[1], f32([2.0, -1.0, 0.5, 1.0, -4.0]))
    masked = MinNewTokens(2, [4])(seqs, batch)
    np.testing.assert_array_equal(masked[:, 4], f32([NEG_INF, -4.0]))


def test_batched_warpers_treat_each_row_alone() -> None:
    batch = f32([[1.0, 3.0, 2.0, 0.5], [4.0, 0.0, 1.0, 2.0]])
    seqs = [view([], []), view([], [])]
    np.testing.assert_array_equal(
        TopK(1)(seqs, batch), f32([[NEG_INF, 3.0, NEG_INF, NEG_INF], [4.0, NEG_INF, NEG_INF, NEG_INF]])
    )
    top_p = TopP(0.01)(seqs, batch)
    np.testing.assert_array_equal(top_p == NEG_INF, [[True, False, True, True], [False, True, True, True]])


def test_a_batch_needs_one_view_per_row() -> None:
    with pytest.raises(ValueError, match="1 sequence views for 2 rows"):
        RepetitionPenalty(2.0)([view([], [])], np.stack([LOGITS, LOGITS]))


def test_build_chain_orders_penalties_mask_temperature_top_k_top_p_min_p() -> None:
    params = SamplingParams(
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        min_new_tokens=3,
    )
    chain = build_chain(params, eos_ids=[2])
    assert [type(p) for p in chain] == [
        RepetitionPenalty,
        PresencePenalty,
        FrequencyPenalty,
        MinNewTokens,
        Temperature,
        TopK,
        TopP,
        MinP,
    ]


def test_a_greedy_chain_keeps_only_what_can_change_the_argmax() -> None:
    params = SamplingParams(
        temperature=0, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2, min_new_tokens=1
    )
    assert [type(p) for p in build_chain(params, eos_ids=[2])] == [RepetitionPenalty, MinNewTokens]


def test_default_sampling_at_temperature_one_needs_no_processor() -> None:
    assert build_chain(SamplingParams(temperature=1.0), eos_ids=[2]) == []


def test_ignore_eos_or_no_eos_ids_drops_the_eos_mask() -> None:
    assert build_chain(SamplingParams(min_new_tokens=2, ignore_eos=True), eos_ids=[2]) == []
    assert build_chain(SamplingParams(min_new_tokens=2), eos_ids=[]) == []


def test_apply_chain_runs_the_processors_in_order() -> None:
    chain = build_chain(SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0), eos_ids=[])
    out = apply_chain(chain, view([3], []), LOGITS)
    # penalty: id 3 -> 1.5; temperature 0.5 doubles: [4, -2, 1, 3, -8]; top-2 keeps 4 and 3.
    np.testing.assert_array_equal(out, f32([4.0, NEG_INF, NEG_INF, 3.0, NEG_INF]))
