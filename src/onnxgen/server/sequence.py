"""One choice of one request while it decodes, and the request groups the scheduler queues.

Every sequence owns its whole selection and stopping chain: processors built from its own
:class:`SamplingParams` (with its own constraint state under a ``response_format``), its own seeded
:class:`Sampler`, token stop checks, incremental detokenizer and stop-string matcher. Rows of a batch share nothing but the forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnxgen.generation.constraints import Constraint
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.processors import TokenChoice, build_chain
from onnxgen.generation.sampling import Sampler
from onnxgen.generation.stopping import StopChecker, StopStringMatcher, StopStrings
from onnxgen.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Delta:
    """What one step added to one choice: a token, the text it completes, and the finish reason at the end.

    ``error`` is set (and ``finish_reason`` is ``"error"``) when the request failed in the engine;
    ``client_error`` when the request itself caused it (its constraint hit a parser limit mid-output).
    """

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None
    error: str | None = None
    client_error: bool = False


class Handle:
    """The asyncio side of a request: the scheduler pushes deltas through ``push`` from its thread."""

    def __init__(self, push: Callable[[list[Delta]], None]) -> None:
        self.push = push
        self.cancelled = False  # set by the asyncio side (client gone); read by the scheduler thread


class SequenceRun:
    """Token selection, stop checks and streamed text for one choice."""

    def __init__(
        self,
        index: int,
        prompt: Sequence[int],
        params: SamplingParams,
        eos_ids: Sequence[int],
        tokenizer: Tokenizer,
        constraint: Constraint | None = None,
        stops: StopStrings | None = None,
    ) -> None:
        """``stops``: ``params.stop`` compiled once for every choice of the request (else compiled here)."""
        self.index = index
        self.params = params
        self.prompt_len = len(prompt)
        self.ids = np.zeros(len(prompt) + params.max_new_tokens, dtype=np.int64)
        self.ids[: len(prompt)] = prompt
        self.n = len(prompt)
        self.constraint = constraint  # response_format: a grammar state of this choice alone
        self.chain = build_chain(params, eos_ids, constraint)
        self.sampler = None if params.is_greedy else Sampler(params.seed)
        self.choose = TokenChoice(self.chain, self.sampler)
        self.checker = StopChecker(params, eos_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt)
        self.stops = StopStringMatcher(stops or params.stop) if params.stop else None
        self.finish_reason: str | None = None
        self.last_token_at = 0.0

    @property
    def generated(self) -> int:
        return self.n - self.prompt_len

    @property
    def last_token(self) -> int:
        return int(self.ids[self.n - 1])

    def select(self, logits: np.ndarray) -> int:
        """The next token from this choice's logits row (processors are out-of-place)."""
        return self.choose(self.ids[: self.n], self.prompt_len, logits)

    def add(self, token: int) -> Delta:
        """Append ``token``; return its delta (the finish reason set when the choice is done)."""
        self.ids[self.n] = token
        self.n += 1
        self.last_token_at = time.perf_counter()
        reason = self.checker.check(token, self.generated)
        if self.constraint is not None and self.constraint.complete(self.ids[self.prompt_len : self.n]):
            reason = "stop"  # the output is complete under the schema: nothing but eos may follow
        piece = self.detok.feed(token)
        if reason is not None:
            piece += self.detok.flush()
        if self.stops is not None:
            match = self.stops.feed(piece)
            piece = match.text
            if match.stopped:
                reason = "stop"
            elif reason is not None:
                piece += self.stops.flush()
        self.finish_reason = reason
        return Delta(self.index, token, piece, reason)


@dataclass
class Job:
    """One prompt of a request and its ``n`` choices: prefilled once, then one batch row per choice."""

    handle: Handle
    prompt: list[int]
    runs: list[SequenceRun]
    arrived: float = field(default_factory=time.perf_counter)
    offset: int = 0  # prompt tokens prefilled so far (prefill runs in chunks between decode steps)

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled
