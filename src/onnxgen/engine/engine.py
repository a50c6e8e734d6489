"""Engine: requests in, tokens out, one :meth:`Engine.step` at a time (vLLM's ``LLMEngine`` shape).

``add_request`` checks a request and queues its :class:`~onnxgen.engine.sequence.Sequence`; each ``step``
runs one scheduler iteration (:class:`~onnxgen.engine.scheduler.Scheduler`: chunked prefill, one batched
decode forward, retirement) and returns what every touched request got; ``abort`` ends a request wherever
it is. Whoever drives it (``LLM.generate`` over a list of prompts, a server's worker thread) loops on
``has_unfinished``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Ids
from dataclasses import dataclass
from typing import Any

from onnxgen.engine.lane import Drafts, LaneFactory
from onnxgen.engine.limits import BatchLimits
from onnxgen.engine.scheduler import Emitted, Scheduler
from onnxgen.engine.sequence import Sequence, TextStream
from onnxgen.errors import GenerationError
from onnxgen.generation.generator import Generator, StreamEvent
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import Speculative

RequestId = str | int


@dataclass
class RequestOutput(StreamEvent):
    """What one step gave one sequence of a request: a :class:`StreamEvent` (token, text, at the end the
    finish reason and statistics) naming its request and choice; ``error`` says why when the finish
    reason is ``"error"``."""

    request_id: RequestId = ""
    index: int = 0  # which of the request's sequences (its choices)
    error: str | None = None


class Engine:
    """Batched generation on one model: the generator's session, tokenizer and checks, a scheduler."""

    def __init__(self, generator: Generator, limits: BatchLimits, drafts: Drafts = lambda _: None) -> None:
        """``drafts`` gives a :class:`~onnxgen.DraftModel`'s loaded draft (what ``LLM`` does)."""
        self.generator = generator
        self.limits = limits
        self.lanes = LaneFactory(generator, drafts)
        self.scheduler = Scheduler(
            generator.session, limits, generator.export, generator.prefix_cache, self.lanes
        )
        self._requests: dict[RequestId, list[Sequence]] = {}
        self._owners: dict[int, tuple[RequestId, int]] = {}  # id(sequence) -> (request, choice index)

    def add_request(
        self,
        request_id: RequestId,
        prompt_ids: Ids[int],
        params: SamplingParams | Ids[SamplingParams],
        speculative: Speculative | None = None,
    ) -> None:
        """Queue a request: one sequence, or with a list of params one per entry (its choices, prefilled
        once; outputs say which by ``index``). With ``speculative`` each sequence drafts and verifies in a
        lane of its own (:mod:`.lane`), giving what ``LLM.generate`` gives it. A bad one (prompt, stop
        strings, constraint, a missing MTP head or draft model, a taken id) raises here."""
        self.lanes.check(speculative)
        if request_id in self._requests:
            raise GenerationError(
                f"request id {request_id!r} is already running; give each request its own id"
            )
        group = []
        for p in [params] if isinstance(params, SamplingParams) else params:
            p, constraint = self.generator.admit(prompt_ids, p, self.limits.max_model_len)
            text = TextStream.of(self.generator.tokenizer, prompt_ids, p)
            group.append(Sequence(prompt_ids, p, self.generator.eos_ids, constraint, text, speculative))
        self.add_sequences(request_id, group)

    def add_sequences(self, request_id: RequestId, group: list[Sequence]) -> None:
        """Queue a request whose sequences (of one prompt) the caller made and checked (the server's
        request preparation); :class:`~onnxgen.engine.scheduler.QueueFull` where the queue is full."""
        if request_id in self._requests:
            raise GenerationError(
                f"request id {request_id!r} is already running; give each request its own id"
            )
        # speculation is off where this model's verify would not give plain decoding's tokens
        for seq in group:
            seq.speculative = self.generator.speculation_for(seq.speculative)
        self.scheduler.add(group)  # raises QueueFull before the request is known
        self._requests[request_id] = group
        for index, seq in enumerate(group):
            self._owners[id(seq)] = (request_id, index)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: an output for each sequence that got a token (or failed)."""
        outputs = [self._output(emitted) for emitted in self.scheduler.step()]
        for out in outputs:
            if out.finish_reason is not None:
                self._forget(out.request_id)
        return outputs

    def abort(self, request_id: RequestId) -> list[RequestOutput]:
        """End a request wherever it is (finish reason ``"abort"``): an output for each of its sequences
        that had not finished (none where no such request runs)."""
        outputs = []
        for index, seq in enumerate(self._requests.get(request_id, [])):
            if seq.finish_reason is None:
                self.scheduler.abort(seq)
                stats = self._stats(seq)
                outputs.append(
                    RequestOutput([], "", seq.finish_reason, stats, request_id=request_id, index=index)
                )
        self._forget(request_id, force=True)
        return outputs

    def _forget(self, request_id: RequestId, force: bool = False) -> None:
        """Drop a request once every sequence of it finished (or at once with ``force``)."""
        group = self._requests.get(request_id, [])
        if force or all(seq.finish_reason is not None for seq in group):
            self._requests.pop(request_id, None)
            for seq in group:
                self._owners.pop(id(seq), None)

    def sequences(self, request_id: RequestId) -> list[Sequence]:
        """The sequences of a request still running (empty once it finished)."""
        return self._requests.get(request_id, [])

    def _output(self, emitted: Emitted) -> RequestOutput:
        seq, reason = emitted.seq, emitted.finish_reason
        rid, index = self._owners[id(seq)]
        if emitted.token < 0:
            return RequestOutput(
                [], "", "error", self._stats(seq), request_id=rid, index=index, error=seq.error
            )
        logprobs = None if emitted.logprob is None else [emitted.logprob]
        stats = self._stats(seq) if reason is not None else None
        return RequestOutput([emitted.token], emitted.text, reason, stats, logprobs, rid, index)

    @staticmethod
    def _stats(seq: Sequence) -> dict[str, Any]:
        end = seq.last_token_at or time.perf_counter()
        first = seq.first_token_at or end
        generated, decode_s = seq.generated, end - first
        return {
            "prompt_tokens": seq.prompt_len,
            "cached_tokens": seq.cached_tokens,
            "generated_tokens": generated,
            "ttft_s": first - seq.arrived,
            "decode_tok_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            "total_s": end - seq.arrived,
            **(seq.constraint.stats() if seq.constraint is not None else {}),
            **seq.extra_stats,
        }
