"""Token selection: greedy argmax and a seeded categorical sampler over one logits row.

Cost notes (the sampler runs once per generated token): exponentials are taken in float32 (several
times faster than float64 exp on CPU) after subtracting the row maximum, so every exponent is <= 0 and
nothing overflows; every sum over them is accumulated in float64. Rows that the processors masked down
to a few live tokens (top-k, top-p) are sampled over those tokens only.
"""

from __future__ import annotations

import math

import numpy as np

from onnxgen.errors import GenerationError

_BLOCK = 1024  # the draw sums the weights per block, then searches inside one block


def _check_row(logits: np.ndarray) -> None:
    if logits.ndim != 1:
        raise ValueError(f"expected one logits row of shape [vocab], got shape {logits.shape}")


def check_model_logits(logits: np.ndarray, export: str) -> None:
    """Raise :class:`GenerationError` when a forward's logits row holds NaN or +inf, or nothing but -inf.

    Greedy decoding would otherwise take ``argmax`` of NaNs (token 0, over and over) and report success.
    One ``max`` over the row: callers check the prompt's forward of each request, not every step.
    """
    top = float(np.max(logits))
    if not math.isfinite(top):
        raise GenerationError(
            f"{export} computed non-finite logits (largest: {top}) for the prompt: its weights hold NaN or "
            "inf, or its arithmetic overflows (e.g. fp16 activations); check the export or re-export it"
        )


def check_chosen(logits: np.ndarray, token: int, export: str, generated: int) -> None:
    """Raise :class:`GenerationError` when the logit of the chosen ``token`` is not finite: a row with
    NaN or +inf anywhere makes greedy's argmax land on one, so one lookup a step catches what
    :func:`check_model_logits` catches for the prompt (a model that overflows only at later positions)."""
    value = float(logits[token])
    if not math.isfinite(value):
        raise GenerationError(
            f"{export} computed non-finite logits ({value} for token {token}) after {generated} generated "
            "tokens: its weights or position tables hold NaN or inf there, or its arithmetic overflows "
            "(e.g. fp16 activations); check the export or re-export it"
        )


def greedy(logits: np.ndarray) -> int:
    """The id of the largest logit; among exact ties the lowest id wins."""
    _check_row(logits)
    return int(np.argmax(logits))


def live_ids(row: np.ndarray) -> np.ndarray | None:
    """The ids of the tokens not masked to ``-inf``, when they are fewer than half the row, else None."""
    live = np.flatnonzero(row != -np.inf)
    return live if 0 < len(live) < len(row) // 2 else None


def weights(logits: np.ndarray) -> np.ndarray:
    """``exp(logits - max)`` over the last axis: unnormalised probabilities (float32, float64 kept)."""
    top = np.max(logits, axis=-1, keepdims=True)
    if not np.all(np.isfinite(top)):
        raise GenerationError(
            "cannot sample: the logits are NaN, +inf, or all masked to -inf; check the model output "
            "and the sampling parameters (top_k/top_p/min_p, min_new_tokens with an all-eos vocabulary)"
        )
    shifted = np.subtract(logits, top, dtype=np.float64 if logits.dtype == np.float64 else np.float32)
    return np.exp(shifted, out=shifted)


def probs(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis as float64; ``-inf`` logits get probability 0.

    Raises :class:`GenerationError` when a row has no finite maximum (all tokens masked, or NaN/inf
    logits), since no distribution can be formed from it.
    """
    p = weights(logits).astype(np.float64, copy=False)
    p /= p.sum(axis=-1, keepdims=True)
    return p


class Sampler:
    """Seeded categorical sampling (``numpy.random.Generator`` on PCG64).

    The same seed gives the same sequence of draws for the same logits; ``seed=None`` seeds from OS
    entropy. Each draw consumes exactly one uniform number.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def sample(self, logits: np.ndarray) -> int:
        """Draw one token id from ``softmax(logits)`` (``logits``: one row ``[vocab]``)."""
        _check_row(logits)
        live = live_ids(logits)
        if live is not None:
            return int(live[self._draw(weights(logits[live]))])
        return self._draw(weights(logits))

    def uniform(self) -> float:
        """One uniform draw in [0, 1) from this sampler's stream (speculative acceptance tests)."""
        return float(self._rng.random())

    def sample_probs(self, p: np.ndarray) -> int:
        """Draw one token id from a probability row ``p`` (non-negative; need not be normalised)."""
        _check_row(p)
        return self._draw(p)

    def _draw(self, w: np.ndarray) -> int:
        """Inverse-CDF draw from non-negative weights ``w``: float64 sums per block of ``_BLOCK`` tokens,
        then a cumulative sum inside the chosen block only."""
        w = w.astype(np.float64, copy=False)
        block_cum = np.cumsum(np.add.reduceat(w, np.arange(0, len(w), _BLOCK)))
        if not block_cum[-1] > 0.0:
            raise GenerationError("cannot sample: the probabilities sum to zero or are NaN")
        target = self._rng.random() * block_cum[-1]  # u < 1 keeps it below the total (round to nearest)
        block = int(np.searchsorted(block_cum, target, side="right"))
        start = block * _BLOCK
        inner = np.cumsum(w[start : start + _BLOCK]) + (block_cum[block - 1] if block else 0.0)
        index = int(np.searchsorted(inner, target, side="right"))
        if index == len(inner):  # summed token by token, the block came out short of the target
            index = int(np.flatnonzero(w[start : start + _BLOCK])[-1])
        return start + index
