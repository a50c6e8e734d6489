from __future__ import annotations

import numpy as np
import pytest

from onnxgen.errors import GenerationError
from onnxgen.generation.sampling import Sampler, greedy, probs


def test_greedy_picks_the_largest_logit() -> None:
    assert greedy(np.array([0.1, -2.0, 5.0, 4.9], dtype=np.float32)) == 2


def test_greedy_breaks_exact_ties_toward_the_lowest_id() -> None:
    assert greedy(np.array([1.0, 3.0, 2.0, 3.0, 3.0], dtype=np.float32)) == 1


def test_greedy_returns_a_python_int() -> None:
    assert type(greedy(np.zeros(3, dtype=np.float32))) is int


def test_greedy_rejects_a_batch() -> None:
    with pytest.raises(ValueError, match="one logits row"):
        greedy(np.zeros((2, 3), dtype=np.float32))


def test_probs_is_the_softmax_with_masked_tokens_at_zero() -> None:
    p = probs(np.array([0.0, np.log(3.0), -np.inf], dtype=np.float32))
    assert p.dtype == np.float64
    np.testing.assert_allclose(p, [0.25, 0.75, 0.0], rtol=1e-7)


def test_probs_is_stable_for_huge_logits() -> None:
    np.testing.assert_allclose(probs(np.array([1000.0, 1000.0], dtype=np.float32)), [0.5, 0.5])


def test_probs_works_row_by_row_on_a_batch() -> None:
    p = probs(np.array([[0.0, 0.0], [0.0, np.log(4.0)]]))
    np.testing.assert_allclose(p, [[0.5, 0.5], [0.2, 0.8]])


@pytest.mark.parametrize("bad", [[-np.inf, -np.inf], [0.0, np.nan], [np.inf, 0.0]])
def test_probs_refuses_rows_with_no_usable_distribution(bad: list[float]) -> None:
    with pytest.raises(GenerationError, match="cannot sample"):
        probs(np.array(bad))


def test_the_same_seed_gives_the_same_draws() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    first, second = Sampler(1234), Sampler(1234)
    assert [first.sample(logits) for _ in range(50)] == [second.sample(logits) for _ in range(50)]


def test_different_seeds_give_different_draws() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    first, second = Sampler(1), Sampler(2)
    assert [first.sample(logits) for _ in range(20)] != [second.sample(logits) for _ in range(20)]


def test_no_seed_draws_from_os_entropy() -> None:
    logits = np.zeros(1_000_000, dtype=np.float32)
    assert [Sampler().sample(logits) for _ in range(3)] != [Sampler().sample(logits) for _ in range(3)]


def test_sampled_frequencies_match_the_softmax_probabilities() -> None:
    expected = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(expected).astype(np.float32)
    sampler, draws = Sampler(0), 20_000
    counts = np.bincount([sampler.sample(logits) for _ in range(draws)], minlength=4)
    chi_square = float(np.sum((counts - draws * expected) ** 2 / (draws * expected)))
    assert chi_square < 16.27  # chi-square critical value, 3 degrees of freedom, p = 0.001


def test_masked_tokens_are_never_drawn() -> None:
    logits = np.full(100, -np.inf, dtype=np.float32)
    logits[[7, 42, 99]] = [0.0, 1.0, 2.0]
    sampler = Sampler(5)
    drawn = {sampler.sample(logits) for _ in range(500)}
    assert drawn == {7, 42, 99}


def test_a_row_with_one_live_token_always_draws_it() -> None:
    logits = np.full(10, -np.inf, dtype=np.float32)
    logits[3] = -50.0
    assert Sampler(0).sample(logits) == 3


def test_sampling_an_all_masked_row_is_an_error() -> None:
    with pytest.raises(GenerationError):
        Sampler(0).sample(np.full(4, -np.inf, dtype=np.float32))


def test_sample_probs_draws_from_an_unnormalised_probability_row() -> None:
    sampler = Sampler(3)
    assert {sampler.sample_probs(np.array([0.0, 2.0, 0.0])) for _ in range(50)} == {1}
    with pytest.raises(GenerationError, match="sum to zero"):
        sampler.sample_probs(np.zeros(3))


def test_frequencies_match_when_the_mass_spreads_over_many_blocks_of_the_vocabulary() -> None:
    logits = np.full(3000, -30.0, dtype=np.float32)  # the other 2997 tokens hold ~3e-10 of the mass
    heavy, expected = [5, 1030, 2999], np.array([0.2, 0.3, 0.5])
    logits[heavy] = np.log(expected)
    sampler, draws = Sampler(11), 5000
    drawn = [sampler.sample(logits) for _ in range(draws)]
    assert set(drawn) == set(heavy)
    counts = np.array([drawn.count(i) for i in heavy])
    chi_square = float(np.sum((counts - draws * expected) ** 2 / (draws * expected)))
    assert chi_square < 13.82  # chi-square critical value, 2 degrees of freedom, p = 0.001


class TopOfRange:
    """A stand-in generator whose uniform draw is the largest float below 1."""

    def random(self) -> float:
        return float(np.nextafter(1.0, 0.0))


def test_a_draw_at_the_top_of_the_range_lands_on_the_last_token_with_mass() -> None:
    sampler = Sampler(0)
    sampler._rng = TopOfRange()  # type: ignore[assignment]
    # Summed per block and then token by token, these weights round differently, so a target at the
    # very top of the range lies past the token-by-token sums; the draw must still be a token with mass.
    p = np.zeros(2048)
    p[:1024] = 0.1
    p[1024:1027] = [0.8227062801815019, 0.41538403737122465, 0.8298039852781027]
    assert sampler.sample_probs(p) == 1026
