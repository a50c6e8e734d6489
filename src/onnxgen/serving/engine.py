"""One engine's OpenAI-compatible app, as ``onnxgen serve`` runs it and as each Ray replica runs it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from onnxgen.server.security import SecurityConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from onnxgen.llm import LLM
    from onnxgen.server.scheduler import SchedulerConfig

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class EngineSpec:
    """What one engine serves and how: the ``onnxgen serve`` flags that shape an engine.

    Attributes:
        model: model directory (on every machine that runs a replica).
        threads: intra-op threads (None: the runtime's default, all cores).
        max_batch, max_queue, prefill_chunk: as ``--max-batch``, ``--max-queue``, ``--prefill-chunk``.
        max_model_len: tokens per sequence (None: the model's context, at most 2048).
        min_rows: rows every decode step runs (None: probed on this CPU, as ``--min-batch-rows auto``).
        served_model_name: model id clients pass (None: the model directory's name).
        security: who may call the app (API key, Host names, CORS origins).
        log_prompts: put each request's prompt into its log line.
        tool_parser: tool-call format (None: chosen from the chat template), as ``--tool-call-parser``.
        prefix_cache_mb, checkpoint_interval: the prefix cache's budget (0: off) and the tokens between
            two state checkpoints of a long prefill, as ``--prefix-cache-mb`` / ``--checkpoint-interval``.
    """

    model: str
    threads: int | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int | None = None
    prefill_chunk: int = 512
    min_rows: int | None = None
    served_model_name: str | None = None
    security: SecurityConfig = field(default_factory=SecurityConfig)
    log_prompts: bool = False
    tool_parser: str | None = None
    prefix_cache_mb: float = 0.0
    checkpoint_interval: int | None = None

    def scheduler_config(self, min_rows: int = 1) -> SchedulerConfig:
        """The scheduler's limits (checked here, before anything loads)."""
        from onnxgen.server.scheduler import SchedulerConfig

        max_len = self.max_model_len or DEFAULT_MAX_MODEL_LEN
        return SchedulerConfig(
            self.max_batch, self.max_queue, max_len, self.prefill_chunk, self.min_rows or min_rows
        )


def load_app(
    spec: EngineSpec, say: Callable[[str], None] = lambda _: None
) -> tuple[FastAPI, SchedulerConfig]:
    """Load the model (saying so, with the time it took), check its outputs, and build the app."""
    from onnxgen.llm import load  # the runtime: imported when a model loads, not with the CLI
    from onnxgen.runtime.batch import invariant_min_rows
    from onnxgen.server.app import create_app
    from onnxgen.server.scheduler import SchedulerConfig

    spec.scheduler_config()  # a bad size is an error before the model loads
    say(f"loading {spec.model}")
    start = time.perf_counter()
    llm = load(
        Path(spec.model),
        threads=spec.threads,
        prefix_cache_mb=spec.prefix_cache_mb,
        checkpoint_interval=spec.checkpoint_interval,
    )
    context = llm.package.context_length
    max_len = spec.max_model_len or min(context or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if context is not None and max_len > context:
        raise ValueError(
            f"--max-model-len {max_len} exceeds the model's context of {context} tokens; lower it"
        )
    check_outputs(llm)
    min_rows = spec.min_rows or invariant_min_rows(llm.package.graph, llm.session)  # probes this CPU
    llm.package.release_graph()  # read again for that probe only
    config = SchedulerConfig(spec.max_batch, spec.max_queue, max_len, spec.prefill_chunk, min_rows)
    app = create_app(
        llm,
        config,
        spec.served_model_name,
        spec.security,
        log_prompts=spec.log_prompts,
        tool_parser=spec.tool_parser,
    )
    say(f"loaded {app.state.server.model_name} in {time.perf_counter() - start:.1f} s")
    return app, config


def check_outputs(llm: LLM) -> None:
    """One token from a one-token prompt: an export whose logits are NaN fails here, not per request."""
    from onnxgen.generation.params import SamplingParams

    llm.generate([llm.eos_token_ids[0] if llm.eos_token_ids else 0], SamplingParams(max_new_tokens=1))
