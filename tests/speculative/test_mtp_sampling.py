"""MTP speculative sampling draws from the plain sampling distribution.

As in test_sampling_distribution: a tiny hybrid (smallest vocabulary, bigram-like, with a head that copies
it about half the time) generates 4 tokens per run with temperature, top-k, top-p and a presence penalty,
over many seeds; the observed sequences are compared with the exact plain-sampling distribution by
Pearson's chi-square at alpha = 1e-3. The head's drafts are sampled from its own processed distribution,
whose rows are the q of the acceptance rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from mtp_helpers import MTPZoo
from speculative_helpers import PROMPT, chi2_critical, chi2_statistic, plain_distribution, spread_sampling

from onnxgen import MTP, SamplingParams
from onnxgen.generation.sampling import Sampler, probs
from onnxgen.generation.speculative import loop as loop_module
from onnxgen.llm import LLM
from onnxgen.testing import MIN_VOCAB_SIZE, TinySpec

SPEC = TinySpec.hybrid(vocab_size=MIN_VOCAB_SIZE, hidden=32, intermediate=64)
FAMILY = "hybrid-mobius"
LENGTH = 4
RUNS = 500
SPECULATIVE = MTP(num_draft_tokens=2, auto=False)


def params(seed: int) -> SamplingParams:
    return spread_sampling(seed, LENGTH)


@pytest.fixture(scope="module")
def llm(mtp_zoo: MTPZoo) -> LLM:
    return mtp_zoo.llm(FAMILY, spec=SPEC)


@pytest.fixture(scope="module")
def exact(llm: LLM) -> dict[tuple[int, ...], float]:
    dist = plain_distribution(llm.session, PROMPT, params(0), llm.eos_token_ids, LENGTH)
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    assert len(dist) > 10, "the sampling settings should leave a spread-out distribution to test"
    return dist


def sample(llm: LLM, runs: int) -> tuple[Counter[tuple[int, ...]], int, int]:
    counts: Counter[tuple[int, ...]] = Counter()
    proposed = accepted = 0
    for seed in range(runs):
        result = llm.generate(PROMPT, params(seed), speculative=SPECULATIVE)
        counts[tuple(result.token_ids)] += 1
        proposed += result.stats["proposed_draft_tokens"]
        accepted += result.stats["accepted_draft_tokens"]
    return counts, proposed, accepted


def test_mtp_speculative_sampling_matches_the_plain_sampling_distribution(
    llm: LLM, exact: dict[tuple[int, ...], float]
) -> None:
    counts, proposed, accepted = sample(llm, RUNS)
    assert proposed >= RUNS
    assert 0.1 < accepted / proposed < 0.95
    stat, df = chi2_statistic(counts, exact, RUNS)  # type: ignore[arg-type]
    assert df >= 5
    assert stat < chi2_critical(df), f"chi-square {stat:.1f}: {counts.most_common(8)}"


def test_the_comparison_rejects_a_correction_drawn_from_p_instead_of_the_residual(
    llm: LLM, exact: dict[tuple[int, ...], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Negative control: accept x with probability min(1, p(x)/q(x)) as it should, but after a rejection
    # draw the correction from p rather than from norm(max(0, p - q)): the tokens the head favours come
    # out too often. The same comparison, on fewer runs, must catch it.
    def from_p(
        rows: Sequence[np.ndarray], drafts: Sequence[int], q: Sequence[np.ndarray] | None, sampler: Sampler
    ) -> tuple[int, int]:
        assert q is not None
        for i, x in enumerate(drafts):
            p = probs(rows[i])
            if sampler.uniform() < min(1.0, p[x] / q[i][x]):
                continue
            return i, sampler.sample_probs(p)
        return len(drafts), sampler.sample_probs(probs(rows[len(drafts)]))

    monkeypatch.setattr(loop_module, "accept_sampled", from_p)
    runs = 400
    counts, proposed, _ = sample(llm, runs)
    assert proposed >= runs
    stat, df = chi2_statistic(counts, exact, runs)  # type: ignore[arg-type]
    assert stat > chi2_critical(df)
