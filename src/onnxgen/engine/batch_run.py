"""Offline batch generation: a list of requests through an :class:`Engine` until every one is done."""

from __future__ import annotations

from collections.abc import Sequence

from onnxgen.engine.engine import Engine, RequestOutput
from onnxgen.generation.generator import GenerationResult
from onnxgen.generation.logprobs import TokenLogprob
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import Speculative


class _Collected:
    """One request's outputs gathered into its :class:`GenerationResult`."""

    def __init__(self, logprobs: bool) -> None:
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.scores: list[TokenLogprob] | None = [] if logprobs else None
        self.result: GenerationResult | None = None

    def feed(self, out: RequestOutput) -> None:
        self.ids.extend(out.token_ids)
        self.parts.append(out.text)
        if self.scores is not None and out.logprobs:
            self.scores.extend(out.logprobs)
        if out.finish_reason is not None:
            stats = dict(out.stats or {})
            if out.error is not None:
                stats["error"] = out.error
            self.result = GenerationResult(
                self.ids, "".join(self.parts), out.finish_reason, stats, self.scores
            )


def run_batch(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    speculative: Speculative | None = None,
) -> list[GenerationResult]:
    """The results of ``prompts`` (each with its ``params``, all drafting with ``speculative`` where
    given) in their order: requests are queued as the engine's queue has room and stepped until all
    finished; an interruption aborts the rest."""
    collected = [_Collected(p.logprobs) for p in params]
    pending = list(range(len(prompts)))[::-1]  # popped from the end: in order
    started: list[int] = []
    try:
        while pending or engine.has_unfinished():
            while pending and engine.scheduler.queue_room() > 0:
                i = pending.pop()
                engine.add_request(i, prompts[i], params[i], speculative)
                started.append(i)
            for out in engine.step():
                collected[int(out.request_id)].feed(out)
    finally:
        for i in started:
            if collected[i].result is None:
                engine.abort(i)
    return [c.result for c in collected if c.result is not None]
