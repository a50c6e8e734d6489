"""Logits processors: one small class per transform, chained in a list.

Protocol: ``processor(seq, logits) -> logits``.

- ``logits`` is float ``[vocab]`` for one sequence, or ``[batch, vocab]`` for a batch of sequences that share
  one chain (the same :class:`~onnxgen.generation.params.SamplingParams`).
- ``seq`` is the :class:`SequenceView` of that sequence (``[vocab]``), or a sequence of views, one per row
  (``[batch, vocab]``). A view carries the prompt+generated ids and the prompt length, so penalties know
  which tokens were generated.
- Processors are out-of-place: they never modify their input; one with nothing to do may return its input
  as is. Masked tokens get ``-inf``. Processors keep no state between calls, so the same chain serves every
  step and every speculative position (each with its own prefix).

:func:`build_chain` builds the chain in a fixed order: logit bias -> repetition, presence, frequency penalties ->
min-new-tokens eos mask -> constraint mask -> temperature -> top-k -> top-p -> min-p. Greedy chains stop
after the constraint mask: the warpers after it cannot change the argmax. The constraint mask (a
:class:`~onnxgen.generation.constraints.Constraint`, one per request) is the one stateful processor: it
follows the sequence it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from onnxgen.generation.params import SamplingParams
from onnxgen.generation.sampling import live_ids, probs

NEG_INF = -np.inf


@dataclass(frozen=True, slots=True)
class SequenceView:
    """The token ids of one sequence: ``ids`` (1-D int, prompt then generated) and ``prompt_len``."""

    ids: np.ndarray
    prompt_len: int

    @property
    def generated(self) -> np.ndarray:
        return self.ids[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        return len(self.ids) - self.prompt_len


Seqs = SequenceView | Sequence[SequenceView]


class LogitsProcessor(Protocol):
    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray: ...


def _views(seq: Seqs) -> Sequence[SequenceView]:
    return (seq,) if isinstance(seq, SequenceView) else seq


def _rows(seq: Seqs, out: np.ndarray) -> Iterable[tuple[SequenceView, np.ndarray]]:
    """Pairs each view with its (writable) row of ``out``; ``out`` is [vocab] or [batch, vocab]."""
    views = _views(seq)
    rows = out.reshape(-1, out.shape[-1])
    if len(views) != len(rows):
        raise ValueError(f"got {len(views)} sequence views for {len(rows)} rows of logits")
    return zip(views, rows, strict=True)


class LogitBias:
    """OpenAI's ``logit_bias``: add a fixed bias to the logits of some token ids (the same for every row)."""

    def __init__(self, bias: Iterable[tuple[int, float]]) -> None:
        pairs = list(bias)
        self.ids = np.array([i for i, _ in pairs], dtype=np.int64)
        self.bias = np.array([b for _, b in pairs], dtype=np.float32)

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        out[..., self.ids] += self.bias.astype(out.dtype, copy=False)
        return out


class RepetitionPenalty:
    """HF semantics: every id seen in prompt+generated has a positive logit divided by ``penalty`` and a
    negative one multiplied by it."""

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        for view, row in _rows(seq, out):
            picked = row[view.ids]
            row[view.ids] = np.where(picked < 0, picked * self.penalty, picked / self.penalty)
        return out


class PresencePenalty:
    """OpenAI semantics: subtract ``penalty`` once from each id that occurs among the generated tokens."""

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        for view, row in _rows(seq, out):
            row[np.unique(view.generated)] -= self.penalty
        return out


class FrequencyPenalty:
    """OpenAI semantics: subtract ``penalty`` times the count of each id among the generated tokens."""

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        for view, row in _rows(seq, out):
            ids, counts = np.unique(view.generated, return_counts=True)
            row[ids] -= self.penalty * counts
        return out


class MinNewTokens:
    """Mask the eos ids with ``-inf`` while fewer than ``min_new_tokens`` tokens were generated."""

    def __init__(self, min_new_tokens: int, eos_ids: Iterable[int]) -> None:
        self.min_new_tokens = min_new_tokens
        self.eos_ids = np.array(sorted(set(eos_ids)), dtype=np.int64)
        self._eos_set = frozenset(int(i) for i in self.eos_ids)
        self.maskable = self._eos_set  # every id masked_ids may return

    def masked_ids(self, view: SequenceView) -> frozenset[int] | None:
        """The ids this processor sets to ``-inf`` for ``view`` and changes nothing else (None: none)."""
        return self._eos_set if view.num_generated < self.min_new_tokens else None

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        if all(view.num_generated >= self.min_new_tokens for view in _views(seq)):
            return logits
        out = logits.copy()
        for view, row in _rows(seq, out):
            if view.num_generated < self.min_new_tokens:
                row[self.eos_ids] = NEG_INF
        return out


class Temperature:
    """Divide the logits by ``temperature`` (> 0)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        return logits / logits.dtype.type(self.temperature)


class TopK:
    """Keep the ``k`` largest logits (and every logit tied with the k-th); mask the rest."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        if self.k >= logits.shape[-1]:
            return logits
        kth = np.partition(logits, -self.k, axis=-1)[..., -self.k, None]
        return np.where(logits < kth, NEG_INF, logits).astype(logits.dtype, copy=False)


class TopP:
    """Nucleus filtering with HF semantics: keep the most likely tokens whose cumulative probability,
    counted before each token, is below ``top_p``; the top token is always kept.

    Among tokens of equal probability at the cut, lower ids are kept first. Only the head of the
    distribution is sorted (grown until it decides the cut), so a peaked distribution costs O(vocab).
    """

    def __init__(self, top_p: float, initial_head: int = 64) -> None:
        self.top_p = top_p
        self.initial_head = initial_head

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        for row in out.reshape(-1, out.shape[-1]):
            live = live_ids(row)
            if live is None:
                row[~self._keep(probs(row))] = NEG_INF
            else:  # after top-k: only the live tokens can be kept
                row[live[~self._keep(probs(row[live]))]] = NEG_INF
        return out

    def _keep(self, p: np.ndarray) -> np.ndarray:
        head = self._sorted_head(p)
        mass_before = np.concatenate(([0.0], np.cumsum(head[:-1])))
        n_keep = int(np.count_nonzero(mass_before < self.top_p))
        last = head[n_keep - 1]
        keep = p > last
        # Ties do not change the sums, only which ids get the last places: give them to the lowest ids.
        tied = np.flatnonzero(p == last)
        keep[tied[: n_keep - np.count_nonzero(keep)]] = True
        return keep

    def _sorted_head(self, p: np.ndarray) -> np.ndarray:
        """The largest probabilities in descending order, enough of them to decide where the cut falls."""
        size = min(self.initial_head, len(p))
        while True:
            head = np.sort(np.partition(p, len(p) - size)[len(p) - size :])[::-1]
            if size == len(p):
                return head
            # The head decides the cut once the tokens tied with its last one all fall past the cut.
            first_of_tail_tie = int(np.searchsorted(-head, -head[-1], side="left"))
            if head[:first_of_tail_tie].sum() >= self.top_p:
                return head
            size = min(size * 4, len(p))


class MinP:
    """Mask tokens whose probability is below ``min_p`` times the top probability.

    Computed on logits: p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p).
    """

    def __init__(self, min_p: float) -> None:
        self.min_p = min_p

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        threshold = logits.max(axis=-1, keepdims=True) + np.log(self.min_p)
        return np.where(logits < threshold, NEG_INF, logits).astype(logits.dtype, copy=False)


def build_chain(
    params: SamplingParams, eos_ids: Iterable[int], constraint: LogitsProcessor | None = None
) -> list[LogitsProcessor]:
    """The processors ``params`` asks for (plus the request's ``constraint`` mask), in the fixed order of
    this module's docstring."""
    chain: list[LogitsProcessor] = []
    if params.logit_bias:
        chain.append(LogitBias(params.logit_bias_pairs))
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(params.repetition_penalty))
    if params.presence_penalty != 0.0:
        chain.append(PresencePenalty(params.presence_penalty))
    if params.frequency_penalty != 0.0:
        chain.append(FrequencyPenalty(params.frequency_penalty))
    eos = [*(() if params.ignore_eos else eos_ids), *params.stop_token_ids]
    if params.min_new_tokens > 0 and eos:
        chain.append(MinNewTokens(params.min_new_tokens, eos))
    if constraint is not None:
        chain.append(constraint)
    if params.is_greedy:
        return chain
    if params.temperature != 1.0:
        chain.append(Temperature(params.temperature))
    if params.top_k > 0:
        chain.append(TopK(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopP(params.top_p))
    if params.min_p > 0.0:
        chain.append(MinP(params.min_p))
    return chain


def apply_chain(chain: Sequence[LogitsProcessor], seq: Seqs, logits: np.ndarray) -> np.ndarray:
    """Run ``logits`` through every processor of ``chain`` in order."""
    for processor in chain:
        logits = processor(seq, logits)
    return logits


class _Sampler(Protocol):
    def sample(self, logits: np.ndarray) -> int: ...


def choose(
    chain: Sequence[LogitsProcessor],
    sampler: _Sampler | None,
    ids: np.ndarray,
    prompt_len: int,
    logits: np.ndarray,
) -> int:
    """The next token of the sequence ``ids`` (prompt then generated): ``logits`` [vocab] through ``chain``,
    then ``sampler`` (the argmax when None).

    A greedy chain that ends with a constraint first takes the argmax of the chain before it and asks the
    constraint for the masked argmax without its mask (``Constraint.greedy_choice``: the same token,
    allowed logits keeping their values and the lowest id winning ties); the mask is computed only where
    it cannot tell. Where the rest of a greedy chain only masks ids (``masked_ids``: ``min_new_tokens``
    holding eos back), the argmax of the raw logits is the answer unless it is a masked id (the
    first maximum stays first when other ids are lowered), so the row is not copied.
    """
    if chain:
        view = SequenceView(ids, prompt_len)
        greedy_choice = getattr(chain[-1], "greedy_choice", None) if sampler is None else None
        if greedy_choice is None:
            if sampler is None:
                return _greedy_argmax(chain, view, logits)[0]
            logits = apply_chain(chain, view, logits)
        else:
            argmax, processed = _greedy_argmax(chain[:-1], view, logits)
            token = greedy_choice(view.generated, argmax)
            if token is not None:
                return int(token)
            if processed is None:
                processed = apply_chain(chain[:-1], view, logits)
            logits = chain[-1](view, processed)
    return int(np.argmax(logits)) if sampler is None else sampler.sample(logits)


class TokenChoice:
    """:func:`choose` for one request's ``chain`` and ``sampler``, resolved once. Greedy, where every
    processor only masks ids and declares all it may ever mask (``maskable``, e.g. :class:`MinNewTokens`'
    eos ids), the argmax of the raw logits is the answer unless it is one of them, which one set lookup
    tells; otherwise (and for such an argmax, or when sampling) :func:`choose` decides."""

    def __init__(self, chain: Sequence[LogitsProcessor], sampler: _Sampler | None) -> None:
        self.chain = chain
        self.sampler = sampler
        sets = [m for p in chain if (m := getattr(p, "maskable", None)) is not None]
        self.maskable: frozenset[int] | None = (
            frozenset().union(*sets) if sampler is None and len(sets) == len(chain) else None
        )

    def __call__(self, ids: np.ndarray, prompt_len: int, logits: np.ndarray) -> int:
        token = self.raw_argmax(logits)
        return token if token is not None else self.by_chain(ids, prompt_len, logits)

    def by_chain(self, ids: np.ndarray, prompt_len: int, logits: np.ndarray) -> int:
        """The choice through the processor chain and sampler, where :meth:`raw_argmax` gave None."""
        return choose(self.chain, self.sampler, ids, prompt_len, logits)

    def raw_argmax(self, logits: np.ndarray) -> int | None:
        """The choice where the raw argmax decides it (no ids needed), else None: call the instance."""
        if self.maskable is not None:
            token = int(logits.argmax())
            if token not in self.maskable:
                return token
        return None


def _greedy_argmax(
    chain: Sequence[LogitsProcessor], view: SequenceView, logits: np.ndarray
) -> tuple[int, np.ndarray | None]:
    """``argmax(apply_chain(chain, view, logits))`` and the processed logits when they were computed
    (None: a chain that only masks ids was not run, the raw argmax being none of them)."""
    masks = [m for p in chain if (m := getattr(p, "masked_ids", None)) is not None]
    if len(masks) == len(chain):
        token = int(logits.argmax())
        if not any(token in ids for m in masks if (ids := m(view)) is not None):
            return token, None
    processed = apply_chain(chain, view, logits)
    return int(np.argmax(processed)), processed
