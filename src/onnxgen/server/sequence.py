"""One choice of one request while it decodes (a :class:`~onnxgen.engine.sequence.Sequence`), and the
request groups the scheduler queues."""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Ids
from dataclasses import dataclass, field

from onnxgen.engine.sequence import Sequence, TextStream
from onnxgen.generation.constraints import Constraint
from onnxgen.generation.logprobs import TokenLogprob
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import Speculative
from onnxgen.generation.stopping import StopStrings
from onnxgen.tokenizer import Tokenizer


@dataclass
class Delta:
    """What one step added to one choice: a token, the text it completes, and the finish reason at the end.

    ``error`` is set (and ``finish_reason`` is ``"error"``) when the request failed in the engine;
    ``client_error`` when the request itself caused it (its constraint hit a parser limit mid-output).
    ``logprob``: the token's log-probability, when the request asked for them.
    """

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None
    error: str | None = None
    client_error: bool = False
    logprob: TokenLogprob | None = None


class Handle:
    """The asyncio side of a request: the scheduler pushes deltas through ``push`` from its thread."""

    def __init__(self, push: Callable[[list[Delta]], None]) -> None:
        self.push = push
        self.cancelled = False  # set by the asyncio side (client gone); read by the scheduler thread
        # prompt tokens resumed from the prefix cache (None: the server has none); set by the scheduler
        # thread before it pushes the prompt's first deltas
        self.cached_tokens: int | None = None


class SequenceRun(Sequence):
    """One choice of a request: a :class:`Sequence` whose tokens the server streams as :class:`Delta` s."""

    def __init__(
        self,
        index: int,
        prompt: Ids[int],
        params: SamplingParams,
        eos_ids: Ids[int],
        tokenizer: Tokenizer,
        constraint: Constraint | None = None,
        stops: StopStrings | None = None,
        speculative: Speculative | None = None,
    ) -> None:
        """``stops``: ``params.stop`` compiled once for every choice of the request (else compiled here);
        ``speculative``: what the choice drafts with (None: plain decoding in the batch)."""
        text = TextStream(tokenizer, prompt, (stops or params.stop) if params.stop else None)
        super().__init__(prompt, params, eos_ids, constraint, text, speculative)
        self.index = index
        self.emitted = 0  # deltas pushed
        self.previous_at = 0.0  # when the token of the last pushed delta was chosen


@dataclass
class Job:
    """One prompt of a request and its ``n`` choices: prefilled once, then one batch row per choice."""

    handle: Handle
    prompt: list[int]
    runs: list[SequenceRun]
    arrived: float = field(default_factory=time.perf_counter)
    started: bool = False  # whether its prefill ended (its cached tokens are counted then)

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled
