"""Lanes: sequences a scheduler decodes alone, each on a decode state of its own, through the library's
single-sequence loop (:meth:`Generator.loop <onnxgen.generation.generator.Generator.loop>`; for speculative
decoding a :class:`~onnxgen.generation.speculative.loop.SpeculativeLoop`).

A speculative sequence verifies its own drafts, a different number of positions each step, so it does not
share the batch's one-token-per-row forward: it runs beside the batch, one verify (or plain step) per
scheduler iteration, and gets the tokens ``LLM.generate`` gives it, prefix cache included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from onnxgen.engine.sequence import Sequence
from onnxgen.generation.generator import Generator
from onnxgen.generation.speculative import Speculative
from onnxgen.generation.token_loop import TokenLoop

log = logging.getLogger(__name__)

Drafts = Callable[[Speculative | None], Generator | None]  # a DraftModel's loaded draft (else None)


class Lane:
    """One sequence and the loop that chooses its tokens; :meth:`tokens` starts it (the prefill runs)."""

    def __init__(self, seq: Sequence, loop: TokenLoop) -> None:
        self.seq = seq
        self.loop = loop
        self._tokens: Iterator[tuple[int, str | None]] | None = None

    def next(self) -> tuple[int, str | None]:
        """The loop's next token and the finish reason it brings (the first call runs the prompt)."""
        if self._tokens is None:
            self._tokens = iter(self.loop.tokens())
        return next(self._tokens)

    @property
    def ready(self) -> bool:
        """Whether the loop holds a chosen token not yet taken (no forward needed for :meth:`next`)."""
        return self.loop.ready > 0


class LaneFactory:
    """Opens and closes lanes on one generator: its states, prefix cache, MTP head and draft models."""

    def __init__(self, generator: Generator, drafts: Drafts = lambda _: None) -> None:
        self.generator = generator
        self.drafts = drafts

    def check(self, speculative: Speculative | None) -> None:
        """Raise, naming what is missing, where ``speculative`` cannot run on this model (no MTP head, a
        draft model that does not load or does not share the tokenizer)."""
        self.generator.check_speculative(speculative)
        self.drafts(speculative)

    def open(self, seq: Sequence) -> Lane:
        loop = self.generator.loop(
            seq.prompt, seq.params, seq.speculative, self.drafts(seq.speculative), seq.constraint
        )
        return Lane(seq, loop)

    def close(self, lane: Lane, finished: bool) -> None:
        """Give the lane's state back; a ``finished`` sequence's state is cached first (the prefix cache),
        and its loop's statistics kept in ``extra_stats``."""
        loop = lane.loop
        if finished:
            lane.seq.extra_stats = {"forward_passes": loop.forward_passes, **loop.stats()}
            try:
                self.generator.cache_reply(loop)
            except Exception:  # the cache must never fail a request
                log.exception("caching a finished sequence failed; it is not cached")
        self.generator.give_back(loop.state)
