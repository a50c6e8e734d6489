"""When a sequence stops: eos ids, length limits, and stop strings matched on streamed text.

Token-level checks (:class:`StopChecker`) answer per generated token; stop strings
(:class:`StopStringMatcher`) are matched on the decoded text as it streams, holding back any tail that
could still become a stop string. Finish reasons follow OpenAI: ``"stop"`` (eos token or stop string) and
``"length"`` (``max_new_tokens`` reached).
"""

from __future__ import annotations

from array import array
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


_CHAR_BITS = 21  # every code point is below 2**21: an edge is keyed by (node << 21) | code point


class StopStrings:
    """A set of stop strings compiled once into an Aho-Corasick automaton, shared by every matcher of a
    request (memory linear in the strings' total length; each matcher keeps only a state and a held tail).

    Node ``v`` stands for a prefix of some stop string, ``depth[v]`` characters long. Following the text
    through :meth:`step` keeps the state at the longest tail of the text that is such a prefix: that tail
    is what a matcher must hold back, and ``ends[v]`` is the length of the longest stop string that ends
    the text there (0 when none does).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not isinstance(stop, str) or not stop for stop in stops):
            raise ValueError(f"stop strings must be non-empty strings (got {list(stops)!r})")
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self._goto: dict[int, int] = {}
        depth, ends = array("l", [0]), array("l", [0])
        for stop in self.stops:
            node = 0
            for ch in stop:
                key = node << _CHAR_BITS | ord(ch)
                child = self._goto.get(key)
                if child is None:
                    child = self._goto[key] = len(depth)
                    depth.append(depth[node] + 1)
                    ends.append(0)
                node = child
            ends[node] = len(stop)
        self.depth = depth
        self.ends = ends
        self._fail = array("l", bytes(depth.itemsize * len(depth)))
        self._link_failures()

    def _link_failures(self) -> None:
        """Failure links in breadth-first order (a node's link is shallower than the node), and ``ends``
        extended along them: a state also ends every stop string that is a suffix of its prefix."""
        mask = (1 << _CHAR_BITS) - 1
        for key, child in sorted(self._goto.items(), key=lambda edge: self.depth[edge[1]]):
            parent = key >> _CHAR_BITS
            if parent:
                self._fail[child] = self.step(self._fail[parent], key & mask)
            if not self.ends[child]:
                self.ends[child] = self.ends[self._fail[child]]

    def step(self, state: int, code: int) -> int:
        """The state after the character with code point ``code``."""
        goto, fail = self._goto, self._fail
        while True:
            child = goto.get(state << _CHAR_BITS | code)
            if child is not None:
                return child
            if not state:
                return 0
            state = fail[state]


class StopStringMatcher:
    """Streams text through a set of stop strings.

    Text that could be the start of a stop string is held back until it is disambiguated. When a stop
    string appears (also across increments, or in the middle of one increment) the text before it is
    emitted, the stop string and everything after it are not, and the matcher reports ``"stop"``. Where
    stop strings overlap, the one that starts first wins (the shortest of those that start there). Call
    :meth:`flush` when generation ends for another reason to release the held-back tail.

    Each character costs one automaton step (amortized constant time); the matcher holds its state and
    at most ``longest stop string - 1`` characters. Pass a compiled :class:`StopStrings` to share it
    between the choices of one request.
    """

    def __init__(self, stops: Sequence[str] | StopStrings) -> None:
        self.automaton = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self.stops = self.automaton.stops
        self._state = 0
        self._pending = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> StopMatch:
        """Add newly decoded ``text``; return what can be emitted now."""
        if self.stopped:
            return StopMatch("", True, "stop")
        if not self.stops:
            return StopMatch(text, False, None)
        auto = self.automaton
        step, ends, longest = auto.step, auto.ends, auto.longest
        state, held = self._state, len(self._pending)
        best = length = -1  # start (in pending + text) and length of the earliest stop string found
        for end, ch in enumerate(text, held + 1):
            state = step(state, ord(ch))
            if ends[state]:
                start = end - ends[state]
                if best < 0 or start < best:
                    best, length = start, ends[state]
            if 0 <= best <= end + 1 - longest:  # one ending later cannot start before ``best``
                break
        pending = self._pending + text
        if best >= 0:
            self.matched, self._pending = pending[best : best + length], ""
            return StopMatch(pending[:best], True, "stop")
        self._state = state
        keep = len(pending) - auto.depth[state]
        self._pending = pending[keep:]
        return StopMatch(pending[:keep], False, None)

    def flush(self) -> str:
        """Release the held-back text (generation ended without a stop string)."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending
