"""Log-probabilities of chosen tokens and of the most likely alternatives, from one logits row.

Which distribution is reported is the request's ``logprobs_mode``: ``"raw"`` (the default, as vLLM's)
scores the model's own distribution, the log-softmax of the logits before any penalty, mask or
temperature; ``"processed"`` scores the distribution the token was drawn from, after the processor chain
(a token the chain masked has ``-inf``). Sums are taken in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxgen.generation.params import SamplingParams
from onnxgen.generation.processors import SequenceView, TokenChoice, apply_chain


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and, best first, the ``top_logprobs`` most likely tokens
    (``(token id, log-probability)``; ties go to the lower id)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(row: np.ndarray) -> np.ndarray:
    """``row - logsumexp(row)`` in float64; ``-inf`` entries stay ``-inf``."""
    row = np.asarray(row, dtype=np.float64).reshape(-1)
    top = row.max()
    if not np.isfinite(top):
        raise ValueError("cannot take log-probabilities of a logits row with no finite maximum")
    return row - (top + np.log(np.exp(row - top).sum()))


def token_logprob(row: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """``token``'s log-probability under ``softmax(row)``, and the ``top`` most likely tokens."""
    logprobs = log_softmax(row)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, len(logprobs))
        candidates = np.argpartition(-logprobs, k - 1)[:k]
        cut = logprobs[candidates].min()  # every token above it is a candidate; ties at it go to low ids
        above = candidates[logprobs[candidates] > cut]
        above = above[np.lexsort((above, -logprobs[above]))]
        tied = np.flatnonzero(logprobs == cut)[: k - len(above)]
        best = tuple((int(i), float(logprobs[i])) for i in (*above, *tied))
    return TokenLogprob(int(token), float(logprobs[token]), best)


def choose_scored(
    choice: TokenChoice, params: SamplingParams, ids: np.ndarray, prompt_len: int, logits: np.ndarray
) -> tuple[int, TokenLogprob]:
    """The next token of ``ids`` as ``choice`` picks it, with its :class:`TokenLogprob` under the request's
    ``logprobs_mode``. In ``"processed"`` mode the token is chosen from the processed row that is scored
    (the same choice: the chain's argmax or the sampler's draw from it)."""
    if params.logprobs_mode == "raw":
        token = choice(ids, prompt_len, logits)
        return token, token_logprob(logits, token, params.top_logprobs)
    processed = apply_chain(choice.chain, SequenceView(ids, prompt_len), logits) if choice.chain else logits
    token = int(np.argmax(processed)) if choice.sampler is None else choice.sampler.sample(processed)
    return token, token_logprob(processed, token, params.top_logprobs)
