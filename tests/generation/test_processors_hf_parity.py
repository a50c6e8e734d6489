"""Parity of the logits warpers with HF transformers' own (external tier: needs torch + transformers)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.generation.processors import MinP, RepetitionPenalty, SequenceView, Temperature, TopK, TopP

pytestmark = pytest.mark.external
torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 4000


def random_batch(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((3, VOCAB)) * 4).astype(np.float32)


def hf(processor: object, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
    out = processor(torch.from_numpy(ids), torch.from_numpy(logits.copy()))  # type: ignore[operator]
    return out.numpy()


def views(ids: np.ndarray) -> list[SequenceView]:
    return [SequenceView(row, len(row)) for row in ids]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (TopK(40), lambda: logits_process.TopKLogitsWarper(40)),
        (TopP(0.9), lambda: logits_process.TopPLogitsWarper(0.9)),
        (TopP(0.3), lambda: logits_process.TopPLogitsWarper(0.3)),
        (MinP(0.05), lambda: logits_process.MinPLogitsWarper(0.05)),
        (Temperature(0.7), lambda: logits_process.TemperatureLogitsWarper(0.7)),
        (RepetitionPenalty(1.3), lambda: logits_process.RepetitionPenaltyLogitsProcessor(1.3)),
    ],
    ids=["top_k", "top_p_0.9", "top_p_0.3", "min_p", "temperature", "repetition"],
)
def test_warpers_mask_and_scale_like_hf(ours: object, theirs: object) -> None:
    logits = random_batch(1)
    ids = np.random.default_rng(2).integers(0, VOCAB, size=(3, 50))
    expected = hf(theirs(), ids, logits)  # type: ignore[operator]
    got = ours(views(ids), logits)  # type: ignore[operator]
    np.testing.assert_array_equal(got == -np.inf, expected == -np.inf)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
