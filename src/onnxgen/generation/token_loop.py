"""TokenLoop: one sequence decoded alone on a decode state of its own, one forward at a time (the
single-sequence fast lane ``LLM.generate`` runs; :class:`~onnxgen.generation.speculative.loop.SpeculativeLoop`
builds on it)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from collections.abc import Sequence as Ids
from typing import Any

import numpy as np

from onnxgen.cache.prefix import Hit, PrefixCache, prefill_with_checkpoints
from onnxgen.engine.sequence import Sequence
from onnxgen.generation.constraints import Constraint
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.sampling import check_chosen, check_model_logits
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState


class TokenLoop(Sequence):
    """Chooses tokens one forward at a time for one sequence, alone on ``state``; counts forwards and
    times them.

    ``ready``: tokens :meth:`tokens` has chosen but not yet yielded (a verify emits several from one
    forward); the next one comes without a forward while it is above 0.
    """

    ready = 0

    def __init__(
        self,
        session: DecoderSession,
        state: DecodeState,
        prompt: Ids[int] | np.ndarray,
        params: SamplingParams,
        eos_ids: Ids[int],
        constraint: Constraint | None = None,
        export: str = "the model",
    ) -> None:
        super().__init__(prompt, params, eos_ids, constraint)
        self.session = session
        self.export = export  # named by the error when the prompt's logits are not finite
        self.state = state
        self.forward_passes = 0
        self.prefill_s = 0.0
        self.cache: PrefixCache | None = None  # set by resume(): the prefill runs from the cached prefix
        self.hit: Hit | None = None
        self.cached_tokens = 0

    def stats(self) -> dict[str, Any]:
        """Loop-specific statistics merged into the result's stats."""
        return {}

    def resume(self, cache: PrefixCache) -> None:
        """Load the longest usable cached prefix of the prompt into the (empty) state; the prefill then
        runs the rest only, caching the prefixes :meth:`PrefixCache.cuts` names on the way."""
        hit = cache.lookup(self.ids[: self.n], whole=True, scope=self.params.cache_scope)
        cache.restore(hit, self.state)
        self.cache, self.hit, self.cached_tokens = cache, hit, hit.tokens

    def _forward_to(self, end: int) -> np.ndarray:
        """Run the prompt's ids from the state's length up to ``end``; the last position's logits."""
        return self.session.forward(self.state, self.ids[None, self.state.length : end], 1, copy=False)[0, -1]

    def _prefill(self) -> np.ndarray:
        """Run the prompt in one forward (from a cached prefix: the rest, in pieces that end where the
        cache takes checkpoints); the last position's logits. Timed as ``prefill_s``."""
        start = time.perf_counter()
        if self.cache is None:
            logits = self._forward_to(self.n)
            self.forward_passes += 1
        else:
            assert self.hit is not None
            logits, passes = prefill_with_checkpoints(
                self.cache,
                self.state,
                self.ids[: self.n],
                self.hit,
                self._forward_to,
                self.params.cache_scope,
            )
            self.forward_passes += passes
        self.prefill_s = time.perf_counter() - start
        check_model_logits(logits, self.export)
        return logits

    def _scored_tokens(self, logits: np.ndarray) -> Iterator[tuple[int, str | None]]:
        """:meth:`_decode` for a request that asks for log-probabilities (one score a token)."""
        while True:
            token = self.select(logits, self.export)
            reason = self.append(token)
            yield token, reason
            if reason is not None:
                return
            logits = self.session.step(self.state, token)
            self.forward_passes += 1

    def tokens(self) -> Iterator[tuple[int, str | None]]:
        """Yield (token id, finish reason or None); the last yielded token carries the reason. The prompt
        runs when this is called."""
        return self._decode(self._prefill())

    def _decode(self, logits: np.ndarray) -> Iterator[tuple[int, str | None]]:
        """Plain decoding on from ``logits``, those of the last forward (after the last id in ``ids``)."""
        return self._scored_tokens(logits) if self.scores is not None else self._steps(logits)

    def _steps(self, logits: np.ndarray) -> Iterator[tuple[int, str | None]]:
        """:meth:`_decode` without log-probabilities: the hot loop."""
        # what runs per token runs with caches the forward evicted: names bound once, and where the raw
        # argmax decides (TokenChoice.raw_argmax) the ids seen so far are not sliced for the chain; where
        # it does not, the chain decides without taking that argmax again
        ids, step, state, check, raw_argmax, by_chain, isfinite = (
            self.ids,
            self.session.step,
            self.state,
            self.check,
            self.choose.raw_argmax,
            self.choose.by_chain,
            math.isfinite,
        )
        while True:
            token = raw_argmax(logits)
            if token is None:
                token = by_chain(ids[: self.n], self.prompt_len, logits)
            if not isfinite(logits[token]):  # NaN / inf in the row: greedy's argmax lands on it
                check_chosen(logits, token, self.export, self.generated)
            ids[self.n] = token
            self.n += 1
            reason = check(token)
            yield token, reason
            if reason is not None:
                return
            logits = step(state, token)
            self.forward_passes += 1
