"""Acceptance rules for speculative decoding (docs/speculative-commit.md).

Both take the target's processed logits for the k+1 verify positions (row i predicts the token after
draft position i; row 0 follows the pending token) and return the accepted draft count j and the token
the target emits after them (the correction at the first rejection, or a bonus after a full accept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from onnxgen.generation.sampling import Sampler, probs


def accept_greedy(target_logits: Sequence[np.ndarray], drafts: Sequence[int]) -> tuple[int, int]:
    """Longest prefix where the target's argmax equals the draft, then the target's own token."""
    return accept_greedy_lazily(lambda i: int(np.argmax(target_logits[i])), drafts)


def accept_greedy_lazily(choose: Callable[[int], int], drafts: Sequence[int]) -> tuple[int, int]:
    """:func:`accept_greedy` with the target's token at verify position i given by ``choose(i)``, asked
    only up to the first mismatch (positions after it are never processed)."""
    for i, d in enumerate(drafts):
        top = choose(i)
        if top != d:
            return i, top
    return len(drafts), choose(len(drafts))


def accept_sampled(
    target_logits: Sequence[np.ndarray],
    drafts: Sequence[int],
    draft_probs: Sequence[np.ndarray] | None,
    sampler: Sampler,
) -> tuple[int, int]:
    """Leviathan et al. / Chen et al.: accept x with probability min(1, p(x)/q(x)); at the first
    rejection sample from norm(max(0, p - q)); after a full accept sample a bonus from the last p.

    ``draft_probs`` None means a deterministic draft (prompt lookup): q is one-hot at the draft token,
    so acceptance is with probability p(x) and the residual is p with x removed.
    """
    for i, x in enumerate(drafts):
        p = probs(target_logits[i])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i][x])
        if q_x > 0.0 and sampler.uniform() < min(1.0, p[x] / q_x):
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        if not residual.sum() > 0.0:  # p == q exactly: any draw from p is the residual
            residual = p
        return i, sampler.sample_probs(residual)
    return len(drafts), sampler.sample_probs(probs(target_logits[len(drafts)]))
