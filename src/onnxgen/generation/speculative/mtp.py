"""MTPProposer: drafts with the model's own multi-token-prediction head.

The head's entry at position i pairs the token after i with the target's final hidden state at i, and
predicts the token after that. The target hands its hidden states over after each of its forwards
(:meth:`observe_target`); the proposer keeps those the head has not fed yet, and the head's KV cache in
two parts: positions whose entries were built from the target's hidden states (``fed``), and the entries
it drafted with past them, whose hidden state was the head's own output.

A proposal, with the target at length L (ids ``[0, L]``, the last one pending):
1. rewind the head's cache to ``fed`` (drop the drafted entries: their hidden states were the head's
   guesses, and the target has since given the real ones, or rejected the tokens);
2. one forward over entries ``fed .. L-1`` (tokens ``ids[fed+1 .. L]``, the target's hidden states): its
   last logits give draft 1, and its output hidden state stands in for the target's at L;
3. draft 2..k: one single-entry forward each, on the previous draft and the head's previous output.
So the head's cache after a partial accept holds exactly what a head fed only the kept tokens holds: the
rewind is a length change (its attention reads past and present in one buffer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from onnxgen.errors import GenerationError
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative.proposers import DraftChoice
from onnxgen.runtime.mtp_head import MTPHeadSession


class MTPProposer:
    """The :class:`~onnxgen.generation.speculative.loop.Proposer` of :class:`~onnxgen.generation.speculative.MTP`."""

    def __init__(
        self,
        head: MTPHeadSession,
        target_hidden: str,
        params: SamplingParams,
        eos_ids: Sequence[int],
        capacity: int,
    ) -> None:
        self.head = head
        self.target_outputs = (target_hidden,)  # what every target forward must hand over
        self.chained = True  # drafts 2..k are made from the head's own hidden state: accepted less often
        self.choose = DraftChoice(params, eos_ids)
        self.state = head.new_state(capacity)
        self.fed = 0  # head cache entries [0, fed) were built from the target's hidden states
        self.known = 0  # the target has handed over its hidden states of positions [0, known) ...
        self._pending: list[np.ndarray] = []  # ... and those of [fed, known) are kept here until fed
        self.head_forwards = 0

    def reset(self, prompt_len: int) -> None:
        self.state.reset()
        self.known = self.fed = 0
        self._pending = []
        self.choose.prompt_len = prompt_len

    def observe_target(self, start: int, fetched: Mapping[str, ort.OrtValue], rows: int) -> None:
        """The target ran positions ``start ..``; keep the hidden states of the first ``rows`` of them (the
        committed ones) until the head has fed them."""
        if start != self.known:
            raise GenerationError(
                f"the MTP head was handed the target's hidden states from position {start}, "
                f"expected {self.known}"
            )
        self._pending.append(fetched[self.target_outputs[0]].numpy()[0, :rows].copy())
        self.known = start + rows

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], list[np.ndarray] | None]:
        target_len = len(ids) - 1
        k = min(k, self.state.capacity - target_len + 1)  # drafted entries reach target_len + k - 1
        if k <= 0 or target_len <= self.fed:
            return [], None
        if self.known != target_len:
            raise GenerationError(
                f"the MTP head has the target's hidden states up to position {self.known}, not {target_len}"
            )
        self.state.rewind(self.fed)
        fresh = np.concatenate(self._pending)[None, : target_len - self.fed]
        logits, hidden = self.head.forward(
            self.state, np.asarray(ids[None, self.fed + 1 :], dtype=np.int64), fresh
        )
        self._pending = []
        self.fed = target_len
        self.head_forwards += 1
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        # the processor chain reads the history (penalties); plain greedy has no chain and reads none
        history = [int(t) for t in ids] if self.choose.chain else []
        for i in range(k):
            token = self.choose(logits, history, rows)
            drafts.append(token)
            history.append(token)
            if i + 1 < k:
                logits, hidden = self.head.forward(
                    self.state, np.array([[token]], dtype=np.int64), hidden[None, None]
                )
                self.head_forwards += 1
        return drafts, (rows if self.choose.sampling else None)

    def observe(self, context_len: int, accepted: int) -> None:
        """Nothing eager: the next :meth:`propose` rewinds the drafted entries."""


__all__ = ["MTPProposer"]
