"""When a sequence stops: eos ids, length limits, and stop strings matched on streamed text.

Token-level checks (:class:`StopChecker`) answer per generated token; stop strings
(:class:`StopStringMatcher`) are matched on the decoded text as it streams, holding back any tail that
could still become a stop string. Finish reasons follow OpenAI: ``"stop"`` (eos token or stop string) and
``"length"`` (``max_new_tokens`` reached).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from onnxgen.generation.params import SamplingParams

FinishReason = Literal["stop", "length"]


class StopChecker:
    """Token-level stopping for one request: eos ids (unless ``ignore_eos``), the request's
    ``stop_token_ids`` and ``max_new_tokens``.

    ``min_new_tokens`` holds back eos only (stop strings apply from the first token); the eos mask in
    :class:`~onnxgen.generation.processors.MinNewTokens` keeps eos from being chosen that early at all.
    """

    def __init__(self, params: SamplingParams, eos_ids: Iterable[int]) -> None:
        eos = frozenset() if params.ignore_eos else frozenset(int(i) for i in eos_ids)
        self.eos_ids = eos | frozenset(params.stop_token_ids)
        self.max_new_tokens = params.max_new_tokens
        self.min_new_tokens = params.min_new_tokens

    def check(self, token_id: int, num_generated: int) -> FinishReason | None:
        """The finish reason after ``token_id`` was generated as token number ``num_generated`` (1-based)."""
        if token_id in self.eos_ids and num_generated >= self.min_new_tokens:
            return "stop"
        if num_generated >= self.max_new_tokens:
            return "length"
        return None


class StopMatch(NamedTuple):
    """What :meth:`StopStringMatcher.feed` returns: the text safe to emit and whether a stop string hit."""

    text: str
    stopped: bool
    finish: FinishReason | None


class StopStringMatcher:
    """Streams text through a set of stop strings.

    Text that could be the start of a stop string is held back until it is disambiguated. When a stop
    string appears (also across increments, or in the middle of one increment) the text before it is
    emitted, the stop string and everything after it are not, and the matcher reports ``"stop"``. Where
    stop strings overlap, the one that starts first wins. Call :meth:`flush` when generation ends for
    another reason to release the held-back tail.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError(f"stop strings must be non-empty (got {list(stops)!r})")
        self.stops = tuple(stops)
        self._prefixes = frozenset(stop[:n] for stop in self.stops for n in range(1, len(stop)))
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
        self._pending = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> StopMatch:
        """Add newly decoded ``text``; return what can be emitted now."""
        if self.stopped:
            return StopMatch("", True, "stop")
        pending = self._pending + text
        hit = self._earliest_stop(pending)
        if hit is not None:
            start, self.matched = hit
            self._pending = ""
            return StopMatch(pending[:start], True, "stop")
        held = self._held_length(pending)
        self._pending = pending[len(pending) - held :]
        return StopMatch(pending[: len(pending) - held], False, None)

    def flush(self) -> str:
        """Release the held-back text (generation ended without a stop string)."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def _earliest_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _held_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0
