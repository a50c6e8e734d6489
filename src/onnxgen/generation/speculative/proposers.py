"""Draft proposers: prompt lookup (n-gram) and a draft model.

A proposer answers ``propose(ids, k) -> (draft tokens, draft probability rows or None)`` given the
whole token history (prompt + generated, ending with the pending token the target has not yet run),
and ``observe(context_len, accepted)`` after the target verified the draft, so a stateful proposer can
commit its own state to exactly the accepted prefix. ``reset(prompt_len)`` starts a request: the
first ``prompt_len`` ids are the prompt, the rest generated (what penalties and min_new_tokens count).
A proposer that reads the target's outputs beyond the logits names them in ``target_outputs`` and gets
them after every target forward through ``observe_target`` (the MTP head: :mod:`.mtp`); these two do
nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from onnxgen.generation.params import SamplingParams
from onnxgen.generation.processors import SequenceView, apply_chain, build_chain
from onnxgen.generation.sampling import Sampler, probs
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState, Snapshot


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens.

    An index from each n-gram (min_ngram <= n <= max_ngram) to the end of its latest occurrence is
    extended as the history grows, so a lookup costs O(max_ngram) dictionary probes, not a scan of
    the history (the history only grows within a request; a shorter or rewritten one is re-indexed).
    """

    target_outputs: tuple[str, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._last_end: dict[tuple[int, ...], int] = {}
        self._history: list[int] = []

    def _index(self, ids: np.ndarray) -> None:
        """Index every n-gram that lies wholly within ``ids[:-1]`` (the tail's own match excluded)."""
        seen = len(self._history)
        if len(ids) < seen or (seen and int(ids[seen - 1]) != self._history[-1]):
            self.reset(0)
            seen = 0
        self._history.extend(int(t) for t in ids[seen:])
        h = self._history
        for end in range(max(seen - 1, 1), len(h)):  # grams ending (exclusive) at `end` <= len - 1
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._last_end[tuple(h[end - n : end])] = end

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], None]:
        self._index(ids)
        h = self._history
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            end = self._last_end.get(tuple(h[len(h) - n :]))
            if end is not None:
                return h[end : end + k], None
        return [], None

    def observe(self, context_len: int, accepted: int) -> None:
        """Nothing to commit: the index follows the history."""

    def observe_target(self, start: int, fetched: Mapping[str, ort.OrtValue], rows: int) -> None:
        """Reads nothing of the target's."""

    def reset(self, prompt_len: int) -> None:
        self._last_end.clear()
        self._history = []


class DraftChoice:
    """How a model that drafts (a draft model, an MTP head) turns its logits into a draft token: the request's
    processor chain (penalties, temperature, top-k/p; no constraint) with the history so far, then the
    argmax when greedy, else a draw from the processed distribution, whose row is the draft's q in the
    acceptance rule (appended to ``rows``)."""

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int]) -> None:
        self.chain = build_chain(params, eos_ids)
        self.sampler = None if params.is_greedy else Sampler(None if params.seed is None else params.seed + 1)
        self.prompt_len = 0

    @property
    def sampling(self) -> bool:
        return self.sampler is not None

    def __call__(self, logits: np.ndarray, history: list[int], rows: list[np.ndarray]) -> int:
        if self.chain:
            logits = apply_chain(self.chain, SequenceView(np.asarray(history), self.prompt_len), logits)
        if self.sampler is None:
            return int(np.argmax(logits))
        p = probs(logits)
        rows.append(p)
        return self.sampler.sample_probs(p)


class DraftModelProposer:
    """A smaller model of the same tokenizer drafts k tokens autoregressively from its own state.

    The draft pins a snapshot of its state after every token it feeds, so committing to any accepted
    prefix is a restore (no replay); a mismatch older than the snapshots falls back to re-feeding.
    """

    target_outputs: tuple[str, ...] = ()

    def __init__(
        self, session: DecoderSession, params: SamplingParams, eos_ids: Sequence[int], capacity: int
    ) -> None:
        self.session = session
        self.params = params
        self.choose = DraftChoice(params, eos_ids)
        self.state: DecodeState = session.new_state(capacity)
        self.fed: list[int] = []
        self.snaps: dict[int, Snapshot] = {}

    def reset(self, prompt_len: int) -> None:
        """Start a new request whose first ``prompt_len`` ids are the prompt (the rest are generated)."""
        self._drop_snaps()
        self.state.reset()
        self.fed = []
        self.choose.prompt_len = prompt_len

    def _drop_snaps(self, keep: int | None = None) -> None:
        for n, snap in list(self.snaps.items()):
            if n != keep:
                self.state.release(snap)
                del self.snaps[n]

    def _sync(self, ids: np.ndarray) -> np.ndarray:
        """Bring the draft state to ``ids[:-1]`` fed; return the logits after the last of ``ids``."""
        common = 0
        limit = min(len(self.fed), len(ids) - 1)  # the last id is always fed: its logits are the answer
        while common < limit and self.fed[common] == ids[common]:
            common += 1
        if common < len(self.fed):
            snap = self.snaps.get(common)
            if snap is not None:
                self.state.restore(snap)
                self.fed = self.fed[:common]
            else:
                self.state.reset()
                self.fed = []
                common = 0
        self._drop_snaps()
        new = ids[common:]
        logits = self.session.forward(self.state, np.asarray(new, dtype=np.int64)[None], 1)[0, -1]
        self.fed.extend(int(t) for t in new)
        return logits

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], list[np.ndarray] | None]:
        room = self.state.capacity - len(ids)
        k = min(k, room)
        if k <= 0:
            return [], None
        logits = self._sync(ids)
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        history = list(ids)
        for i in range(k):
            token = self.choose(logits, history, rows)
            drafts.append(token)
            history.append(token)
            if i + 1 < k:
                self.snaps[len(self.fed)] = self.state.snapshot()
                logits = self.session.forward(self.state, np.array([[token]], dtype=np.int64), 1)[0, -1]
                self.fed.append(token)
        self.snaps[len(self.fed)] = self.state.snapshot()
        return drafts, (rows if self.choose.sampling else None)

    def observe(self, context_len: int, accepted: int) -> None:
        """Nothing eager: the next :meth:`propose` restores the snapshot of the accepted prefix."""

    def observe_target(self, start: int, fetched: Mapping[str, ort.OrtValue], rows: int) -> None:
        """Reads nothing of the target's."""
