"""Lanes: sequences a scheduler decodes alone, each on a decode state of its own, through the library's
single-sequence loop (:meth:`Generator.loop <onnxgen.generation.generator.Generator.loop>`; for speculative
decoding a :class:`~onnxgen.generation.speculative.loop.SpeculativeLoop`).

A speculative sequence verifies its own drafts, a different number of positions each step, so it does not
share the batch's one-token-per-row forward: it runs beside the batch, one verify (or plain step) per
scheduler iteration, and gets the tokens ``LLM.generate`` gives it, prefix cache included. A greedy or
unseeded one yields to company (:mod:`.scheduler`): its state moves into a batch row and back (:meth:`Lane.adopt`), its
loop and proposer kept meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np

from onnxgen.engine.sequence import Sequence
from onnxgen.generation.generator import Generator
from onnxgen.generation.speculative import Speculative
from onnxgen.generation.speculative.loop import SpeculativeLoop
from onnxgen.generation.token_loop import TokenLoop
from onnxgen.runtime.state import DecodeState

log = logging.getLogger(__name__)

Drafts = Callable[[Speculative | None], Generator | None]  # a DraftModel's loaded draft (else None)


class Lane:
    """One sequence and the loop that chooses its tokens; :meth:`tokens` starts it (the prefill runs)."""

    def __init__(self, seq: Sequence, loop: TokenLoop) -> None:
        self.seq = seq
        self.loop = loop
        self._tokens: Iterator[tuple[int, str | None]] | None = None
        self.emitted = 0  # tokens the lane gave the sequence (the rest came from batch rows)
        self.yields = 0  # times it moved into a batch row

    @property
    def started(self) -> bool:
        """Whether the lane has run its prompt (its state holds the sequence but the pending token)."""
        return self._tokens is not None

    @property
    def movable(self) -> bool:
        """Whether the sequence may decode in a batch row for a while (:attr:`Sequence.may_yield`)."""
        return self.seq.may_yield and isinstance(self.loop, SpeculativeLoop)

    def adopt(self, load: Callable[[DecodeState], None]) -> None:
        """Go on from where a batch row left the sequence: ``load`` writes the row's state into the loop's;
        the loop drafts again from the sequence's pending token."""
        loop, seq = self.loop, self.seq
        assert isinstance(loop, SpeculativeLoop)
        loop.adopt(np.array(seq.ids[: seq.n]), seq.scores, load)
        self._tokens = iter(loop.drafting())

    def next(self) -> tuple[int, str | None]:
        """The loop's next token and the finish reason it brings (the first call runs the prompt)."""
        if self._tokens is None:
            self._tokens = iter(self.loop.tokens())
        self.emitted += 1
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

    def open(self, seq: Sequence, resume: bool = True) -> Lane:
        """A lane for ``seq``; ``resume=False``: its prompt is not looked up in the prefix cache (a sequence
        that decoded in a batch row first: :meth:`Lane.adopt` fills its state)."""
        loop = self.generator.loop(
            seq.prompt, seq.params, seq.speculative, self.drafts(seq.speculative), seq.constraint, resume
        )
        return Lane(seq, loop)

    def close(self, lane: Lane, finished: bool, cache: bool = True) -> None:
        """Give the lane's state back; a ``finished`` sequence's state is cached first (the prefix cache;
        not with ``cache=False``: it finished in a batch row, which the scheduler caches), and its loop's
        statistics kept in ``extra_stats``."""
        loop, seq = lane.loop, lane.seq
        if finished:
            batched = seq.generated - lane.emitted  # tokens its batch rows chose, one forward each
            seq.extra_stats = {
                "forward_passes": loop.forward_passes + batched,
                **loop.stats(),
                "speculation_yields": lane.yields,
                "batch_row_tokens": batched,
            }
        if finished and cache:
            try:
                self.generator.cache_reply(loop)
            except Exception:  # the cache must never fail a request
                log.exception("caching a finished sequence failed; it is not cached")
        self.generator.give_back(loop.state)
