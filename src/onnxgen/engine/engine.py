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

from onnxgen.engine.limits import BatchLimits
from onnxgen.engine.scheduler import Emitted, Scheduler
from onnxgen.engine.sequence import Sequence, TextStream
from onnxgen.errors import GenerationError
from onnxgen.generation.generator import Generator, StreamEvent
from onnxgen.generation.params import SamplingParams

RequestId = str | int


@dataclass
class RequestOutput(StreamEvent):
    """What one step gave one request: a :class:`StreamEvent` (token, text, at the end the finish reason
    and statistics) naming its request; ``error`` says why when the finish reason is ``"error"``."""

    request_id: RequestId = ""
    error: str | None = None


class Engine:
    """Batched generation on one model: the generator's session, tokenizer and checks, a scheduler."""

    def __init__(self, generator: Generator, limits: BatchLimits) -> None:
        self.generator = generator
        self.limits = limits
        self.scheduler = Scheduler(generator.session, limits, generator.export)
        self._requests: dict[RequestId, Sequence] = {}

    def add_request(self, request_id: RequestId, prompt_ids: Ids[int], params: SamplingParams) -> None:
        """Queue a request; a bad one (prompt, stop strings, constraint, a taken id) raises here."""
        if request_id in self._requests:
            raise GenerationError(
                f"request id {request_id!r} is already running; give each request its own id"
            )
        params, constraint = self.generator.admit(prompt_ids, params, self.limits.max_model_len)
        text = TextStream.of(self.generator.tokenizer, prompt_ids, params)
        seq = Sequence(prompt_ids, params, self.generator.eos_ids, constraint, text)
        self.scheduler.add(seq)  # raises QueueFull before the request is known
        self._requests[request_id] = seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: an output for each request that got a token (or failed)."""
        ids = {id(seq): rid for rid, seq in self._requests.items()}
        outputs = []
        for emitted in self.scheduler.step():
            rid = ids[id(emitted.seq)]
            outputs.append(self._output(rid, emitted))
            if emitted.finish_reason is not None:
                del self._requests[rid]
        return outputs

    def abort(self, request_id: RequestId) -> RequestOutput | None:
        """End a request wherever it is (finish reason ``"abort"``); None where no such request runs."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        return RequestOutput([], "", seq.finish_reason, self._stats(seq), request_id=request_id)

    def _output(self, rid: RequestId, emitted: Emitted) -> RequestOutput:
        seq, reason = emitted.seq, emitted.finish_reason
        if emitted.token < 0:
            return RequestOutput([], "", "error", self._stats(seq), request_id=rid, error=seq.error)
        logprobs = None if emitted.logprob is None else [emitted.logprob]
        stats = self._stats(seq) if reason is not None else None
        return RequestOutput([emitted.token], emitted.text, reason, stats, logprobs, request_id=rid)

    @staticmethod
    def _stats(seq: Sequence) -> dict[str, Any]:
        end = seq.last_token_at or time.perf_counter()
        first = seq.first_token_at or end
        generated, decode_s = seq.generated, end - first
        return {
            "prompt_tokens": seq.prompt_len,
            "generated_tokens": generated,
            "ttft_s": first - seq.arrived,
            "decode_tok_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            "total_s": end - seq.arrived,
            **(seq.constraint.stats() if seq.constraint is not None else {}),
        }
