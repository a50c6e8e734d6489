"""The incremental n-gram index proposes exactly what a scan of the whole history would."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.generation.speculative.proposers import NgramProposer


def _scan(ids: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        tail = list(ids[len(ids) - n :])
        for start in range(len(ids) - 1 - n, -1, -1):  # latest occurrence within ids[:-1]
            if list(ids[start : start + n]) == tail:
                return [int(t) for t in ids[start + n : start + n + k]]
    return []


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(3, 1), (4, 2), (1, 1)])
def test_growing_histories_get_the_same_drafts_as_a_full_scan(max_ngram: int, min_ngram: int) -> None:
    rng = np.random.default_rng(7)
    for _ in range(100):
        ids = rng.integers(0, 5, size=int(rng.integers(2, 50)))
        proposer = NgramProposer(max_ngram, min_ngram)
        for length in range(2, len(ids) + 1):
            drafts, q = proposer.propose(ids[:length], 4)
            assert q is None
            assert drafts == _scan(ids[:length], 4, max_ngram, min_ngram)


def test_a_rewritten_or_shorter_history_is_reindexed() -> None:
    proposer = NgramProposer()
    assert proposer.propose(np.array([1, 2, 3, 1, 2]), 2)[0] == [3, 1]
    # a different request whose history shares nothing with the last one
    assert proposer.propose(np.array([9, 8, 9]), 2)[0] == [8, 9]
    assert proposer.propose(np.array([4, 4]), 3)[0] == [4]
