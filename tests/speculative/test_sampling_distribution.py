"""Speculative sampling draws from the plain sampling distribution (Leviathan et al. 2023; Chen et al. 2023).

A tiny hybrid model with the smallest vocabulary the tokenizer allows generates 4 tokens per run with
temperature, top-k, top-p and a presence penalty active, over many seeds. The exact distribution of the
4-token sequence under plain sampling is enumerated from the model (each step's logits through the same
processor chain, with that step's prefix), and the observed sequences are compared with it by Pearson's
chi-square at alpha = 1e-3. Runs are seeded, so the outcome is reproducible; with 3 comparisons the chance
that a correct implementation fails for an unlucky choice of seeds is about 0.3%.

Four tokens exercise every path: the first comes from the prefill, then a verify of up to 2 drafts
(accepted, or a correction sampled from the residual), then the bonus token or another step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from speculative_helpers import (
    PROMPT,
    ModelZoo,
    chi2_critical,
    chi2_statistic,
    greedy,
    plain_distribution,
    spread_sampling,
)

from onnxgen import DraftModel, PromptLookup, SamplingParams
from onnxgen.generation.sampling import Sampler, probs
from onnxgen.generation.speculative import loop as loop_module
from onnxgen.llm import LLM
from onnxgen.testing import MIN_VOCAB_SIZE, TinySpec

SPEC = TinySpec.hybrid(vocab_size=MIN_VOCAB_SIZE, hidden=32, intermediate=64)  # small: many runs
FAMILY = "hybrid-mobius"
LENGTH = 4
RUNS = 500


def params(seed: int) -> SamplingParams:
    return spread_sampling(seed, LENGTH)


@dataclass
class Setup:
    llm: LLM
    draft: LLM
    prompt: list[int]
    exact: dict[tuple[int, ...], float]


@pytest.fixture(scope="module")
def setup(zoo: ModelZoo) -> Setup:
    llm = zoo.llm(FAMILY, spec=SPEC)
    out = greedy(llm, PROMPT, 8).token_ids
    prompt = [*PROMPT, *out, *PROMPT, *out[:2]]  # repeats: prompt lookup finds drafts to propose
    exact = plain_distribution(llm.session, prompt, params(0), llm.eos_token_ids, LENGTH)
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    assert len(exact) > 10, "the sampling settings should leave a spread-out distribution to test"
    return Setup(llm, zoo.llm(FAMILY, "int4", spec=SPEC), prompt, exact)


def sample(
    setup: Setup, speculative: PromptLookup | DraftModel | None, runs: int
) -> tuple[Counter, int, int]:
    """Counts of the generated sequences over ``runs`` seeds, and the proposed and accepted draft totals."""
    counts: Counter[tuple[int, ...]] = Counter()
    proposed = accepted = 0
    for seed in range(runs):
        result = setup.llm.generate(setup.prompt, params(seed), speculative=speculative)
        counts[tuple(result.token_ids)] += 1
        proposed += result.stats.get("proposed_draft_tokens", 0)
        accepted += result.stats.get("accepted_draft_tokens", 0)
    return counts, proposed, accepted


def chi2(setup: Setup, counts: Counter, runs: int) -> tuple[float, float]:
    stat, df = chi2_statistic(counts, setup.exact, runs)  # type: ignore[arg-type]
    assert df >= 5
    return stat, chi2_critical(df)


def test_plain_sampling_matches_the_enumerated_distribution(setup: Setup) -> None:
    # The control: the enumeration is the distribution the plain sampler draws from.
    runs = 300
    counts, _, _ = sample(setup, None, runs)
    stat, critical = chi2(setup, counts, runs)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_speculative_sampling_matches_the_plain_sampling_distribution(setup: Setup, method: str) -> None:
    speculative = PromptLookup(num_draft_tokens=4) if method == "prompt-lookup" else DraftModel(setup.draft)
    counts, proposed, accepted = sample(setup, speculative, RUNS)
    # The test means something only if drafts were proposed often and both accepted and rejected.
    assert proposed >= RUNS
    assert 0.1 < accepted / proposed < 0.95
    stat, critical = chi2(setup, counts, RUNS)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: {counts.most_common(8)}"


def test_the_comparison_rejects_a_sampler_that_resamples_the_rejected_draft(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Negative control: after rejecting a lookup draft x, sampling the correction from p (x included)
    # instead of p without x over-weights x. The same comparison, on fewer runs, must catch it.
    def wrong(
        rows: Sequence[np.ndarray], drafts: Sequence[int], q: object, sampler: Sampler
    ) -> tuple[int, int]:
        for i, x in enumerate(drafts):
            p = probs(rows[i])
            if sampler.uniform() >= p[x]:
                return i, sampler.sample_probs(p)
        return len(drafts), sampler.sample_probs(probs(rows[len(drafts)]))

    monkeypatch.setattr(loop_module, "accept_sampled", wrong)
    runs = 200
    counts, proposed, _ = sample(setup, PromptLookup(num_draft_tokens=4), runs)
    assert proposed >= runs
    stat, critical = chi2(setup, counts, runs)
    assert stat > critical
