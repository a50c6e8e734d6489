"""The onnxgen side of ``onnxgen bench``, as it runs inside a worker process.

:class:`OnnxgenEngine` loads the model with the worker's decode plan and (optionally) speculative setting,
and times greedy runs through :meth:`onnxgen.llm.LLM.stream`: prefill is the time of the run's leading
prefill forwards as the session's forward observer reports them (:mod:`onnxgen.runtime.observer`), TTFT
the time to the first event, one step per later token. A speculative run is the same call with the
engine's :class:`~onnxgen.generation.speculative.PromptLookup` or
:class:`~onnxgen.generation.speculative.DraftModel` (a draft model is loaded once, at start).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import takewhile
from pathlib import Path
from typing import Any

from onnxgen.bench.constraints import constraint_kwargs
from onnxgen.bench.genai_engine import GENAI, BenchError, GenaiEngine, step_durations_ms
from onnxgen.bench.worker import peak_rss_mb, rss_mb, serve
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import Speculative
from onnxgen.generation.speculative.spec import SpeculativeSpec
from onnxgen.llm import draft_threads, load
from onnxgen.runtime import hugepages
from onnxgen.runtime.observer import ForwardEvent

ONNXGEN = "onnxgen"
ENGINES = (ONNXGEN, GENAI)
SPECULATIVE_STATS = (
    "proposed_draft_tokens",
    "accepted_draft_tokens",
    "target_forward_passes",
    "state_replays",
    "speculation",  # MTP auto: on, or off after n verifies
    "predicted_speedup",
)
CONSTRAINT_STATS = ("constraint_s", "constraint_masks", "constraint_unmasked")


class OnnxgenEngine:
    """onnxgen's :class:`~onnxgen.llm.LLM`, driven through its stream; the session's forward observer
    collects each run's forwards (so prefill is the prefill forwards alone)."""

    name = ONNXGEN

    def __init__(
        self,
        model_dir: str | Path,
        threads: int,
        decode_plan: str = "auto",
        speculative: SpeculativeSpec | None = None,
        fast_ops: bool | None = None,
    ) -> None:
        start = time.perf_counter()
        self.llm = load(
            model_dir,
            threads=threads,
            decode_plan=decode_plan,
            speculative=speculative is not None,
            fast_ops=fast_ops,
        )
        self.load_s = time.perf_counter() - start
        self.rss_load_mb, self.peak_load_mb = rss_mb(), peak_rss_mb()
        # huge pages are collapsed on a background thread after a large load: runs start after it, so
        # that it neither competes for the cores nor leaves the first runs on small pages
        start = time.perf_counter()
        hugepages.wait()
        self.settle_s = time.perf_counter() - start
        self.requested_plan = decode_plan
        self.speculative: Speculative | None = None
        if speculative is not None:
            draft = (
                load(speculative.draft_path, threads=draft_threads(threads))
                if speculative.draft_path
                else None
            )
            self.speculative = speculative.build(draft)
        self.forwards: list[ForwardEvent] = []
        self.llm.session.forward_observer = self.forwards.append

    def info(self) -> dict[str, Any]:
        from onnxgen import __version__

        vocab = self.llm.session.vocab_size
        if vocab <= 0 and self.llm.tokenizer is not None:
            vocab = self.llm.tokenizer.vocab_size
        return {
            "version": __version__,
            "vocab_size": vocab,
            "context_length": self.llm.package.context_length,
            "fast_ops": self.llm.session.fast_ops.summary(),
            "decode_fusions": self.llm.session.fusions.summary(),
            "prepared_graph": self.llm.session.prepared.cache,
            "load_s": self.load_s,
            "rss_load_mb": self.rss_load_mb,
            "peak_load_mb": self.peak_load_mb,
            "settle_s": self.settle_s,
            **self.plan_info(),
        }

    def plan_info(self) -> dict[str, str]:
        """The decode plan asked for, the one single-token steps run on now, and why."""
        plan = self.llm.decode_plan.plan
        failed = getattr(plan, "failed", None)
        reason = plan.choice.reason if failed is None else f"the inline plan failed, so scan: {failed}"
        return {
            "decode_plan_requested": self.requested_plan,
            "decode_plan": plan.name,
            "decode_plan_reason": reason,
        }

    def encode(self, text: str, special: bool = True) -> list[int]:
        tokenizer = self.llm._require_tokenizer()
        return tokenizer.encode(text, add_special_tokens=special)

    def run(
        self, prompt: Sequence[int], new_tokens: int, speculative: bool = False, constraint: str | None = None
    ) -> dict[str, Any]:
        if speculative and self.speculative is None:
            raise BenchError("a speculative run was asked of a worker started without --speculative")
        # min_new_tokens = max_new_tokens masks end-of-sequence at every step, as onnxruntime-genai's
        # min_length does, so both engines pick the same greedy tokens (ignore_eos would not mask it).
        # Token ids only, as the onnxruntime-genai worker's loop (generate_next_token) produces.
        kwargs = constraint_kwargs(constraint) if constraint else {}
        params = SamplingParams(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0, detokenize=False, **kwargs
        )
        self.forwards.clear()
        ids: list[int] = []
        stamps: list[float] = []
        stats: dict[str, Any] = {}
        start = time.perf_counter()
        for event in self.llm.stream(list(prompt), params, self.speculative if speculative else None):
            stamps.append(time.perf_counter())
            ids.extend(event.token_ids)
            stats = event.stats or stats
        result = {
            "prefill_ms": 1000.0
            * sum(f.seconds for f in takewhile(lambda f: f.phase == "prefill", self.forwards)),
            "ttft_ms": 1000.0 * (stamps[0] - start),
            "step_ms": step_durations_ms(stamps),
            "total_ms": 1000.0 * (stamps[-1] - start),
            "token_ids": ids,
            "forward_passes": stats.get("forward_passes"),
            **self.plan_info(),
        }
        result.update({key: stats[key] for key in (*SPECULATIVE_STATS, *CONSTRAINT_STATS) if key in stats})
        return result


def make_engine(name: str, model: str, threads: int, options: dict[str, Any]) -> OnnxgenEngine | GenaiEngine:
    if name == ONNXGEN:
        spec = options.get("speculative")
        return OnnxgenEngine(
            model,
            threads,
            decode_plan=options.get("decode_plan") or "auto",
            speculative=SpeculativeSpec(**spec) if spec else None,
            fast_ops=options.get("fast_ops"),
        )
    if name == GENAI:
        return GenaiEngine(model, threads)
    raise BenchError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a benchmark worker subprocess (see :mod:`onnxgen.bench.worker`)."""
    return serve(make_engine, argv)
