"""One engine's OpenAI-compatible app, as ``onnxgen serve`` runs it and as each Ray replica runs it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from onnxgen.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from onnxgen.generation.speculative.spec import SpeculativeSpec, parse_speculative
from onnxgen.server.cache_scope import DEFAULT_CACHE_SCOPE
from onnxgen.server.security import SecurityConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from onnxgen.engine.limits import BatchLimits
    from onnxgen.llm import LLM


@dataclass(frozen=True)
class EngineSpec:
    """What one engine serves and how: the ``onnxgen serve`` flags that shape an engine.

    Attributes:
        model: model directory (on every machine that runs a replica).
        threads: intra-op threads (None: the runtime's default, all cores).
        max_batch, max_queue, prefill_chunk: as ``--max-batch``, ``--max-queue``, ``--prefill-chunk``.
        max_model_len: tokens per sequence (None: the model's context, at most 2048).
        min_rows: rows every decode step runs (None: probed on this CPU, as ``--min-batch-rows auto``).
        batch_prefill: True as ``--batch-prefill`` (equal-length prompts in one prefill forward).
        served_model_name: model id clients pass (None: the model directory's name).
        security: who may call the app (API key, Host names, CORS origins).
        log_prompts: put each request's prompt into its log line.
        tool_parser: tool-call format (None: the one the chat template shows, else hermes), as
            ``--tool-call-parser``.
        chat_template: the text of a chat template that replaces the model's own, as ``--chat-template``.
        prefix_cache_mb, checkpoint_interval: the prefix cache's budget (0: off) and the tokens between
            two state checkpoints of a long prefill, as ``--prefix-cache-mb`` / ``--checkpoint-interval``.
        prefix_cache_scope: which requests share cached prefixes, as ``--prefix-cache-scope``
            (:mod:`onnxgen.server.cache_scope`).
        decode_plan, fast_ops: as ``--decode-plan`` / ``--fast-ops`` (:class:`~onnxgen.config.EngineConfig`).
        spinning: False as ``--no-spinning`` (None: the environment's, else onnxruntime's spinning threads).
        speculative, draft_tokens: what requests draft with unless they say otherwise, as ``--speculative``
            (``prompt-lookup``, ``draft:PATH``, ``mtp``, ``mtp-always``; None: plain decoding) and
            ``--draft-tokens``.
    """

    model: str
    threads: int | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int | None = None
    prefill_chunk: int = 512
    min_rows: int | None = None
    batch_prefill: bool = False
    served_model_name: str | None = None
    security: SecurityConfig = field(default_factory=SecurityConfig)
    log_prompts: bool = False
    tool_parser: str | None = None
    chat_template: str | None = None
    prefix_cache_mb: float = 0.0
    checkpoint_interval: int | None = None
    prefix_cache_scope: str = DEFAULT_CACHE_SCOPE
    decode_plan: str = "auto"
    fast_ops: bool | None = None
    spinning: bool | None = None
    speculative: str | None = None
    draft_tokens: int | None = None

    def engine_config(self) -> EngineConfig:
        """The engine's settings: this spec's over the environment's (:meth:`EngineConfig.from_env`)."""
        return EngineConfig.from_env(
            threads=self.threads,
            decode_plan=self.decode_plan,
            fast_ops=self.fast_ops,
            spinning=self.spinning,
            max_batch=self.max_batch,
            max_queue=self.max_queue,
            max_model_len=self.max_model_len,
            prefill_chunk=self.prefill_chunk,
            min_rows=self.min_rows,
            batch_prefill=self.batch_prefill,
            prefix_cache_mb=self.prefix_cache_mb,
            checkpoint_interval=self.checkpoint_interval,
            speculative=self.speculative is not None or None,
        )

    def speculative_spec(self) -> SpeculativeSpec | None:
        """``speculative`` and ``draft_tokens`` checked (a bad one raises ``ValueError`` naming the fix)."""
        return parse_speculative(self.speculative, self.draft_tokens)

    def scheduler_config(self, min_rows: int = 1) -> BatchLimits:
        """The scheduler's limits (checked here, before anything loads)."""
        from onnxgen.engine.limits import BatchLimits

        c = self.engine_config()
        max_len = c.max_model_len or DEFAULT_MAX_MODEL_LEN
        return BatchLimits(c.max_batch, c.max_queue, max_len, c.prefill_chunk, c.min_rows or min_rows)


def load_app(spec: EngineSpec, say: Callable[[str], None] = lambda _: None) -> tuple[FastAPI, BatchLimits]:
    """Load the model (saying so, with the time it took), check its outputs, and build the app."""
    from onnxgen.engine.limits import BatchLimits, default_max_model_len
    from onnxgen.llm import load  # the runtime: imported when a model loads, not with the CLI
    from onnxgen.server.app import create_app

    config = spec.engine_config()
    spec.scheduler_config()  # a bad size is an error before the model loads
    speculative = spec.speculative_spec()  # so is a bad --speculative
    say(f"loading {spec.model}")
    start = time.perf_counter()
    llm = load(Path(spec.model), config, chat_template=spec.chat_template)
    check_outputs(llm)
    if llm.tokenizer is not None and llm.tokenizer.chat_template is None:
        say(
            "warning: the model has no chat template, so /v1/chat/completions will answer 400; "
            "pass --chat-template FILE to serve chats"
        )
    default = speculative.build() if speculative is not None else None
    llm.check_speculative(default)  # the MTP head, the draft model (loaded now): an error before serving
    limits = BatchLimits.resolve(config, llm.package, llm.session)  # the context; this CPU's probe
    context = llm.package.context_length
    if config.max_model_len is None and context is not None and limits.max_model_len < context:
        # the default cut the model's context to the KV budget: say so, and why
        why = default_max_model_len(llm.io, context, config.max_batch)[1]
        say(f"{limits.max_model_len} tokens per sequence ({why})")
    app = create_app(
        llm,
        limits,
        spec.served_model_name,
        spec.security,
        log_prompts=spec.log_prompts,
        tool_parser=spec.tool_parser,
        speculative=default,
        prefix_cache_scope=spec.prefix_cache_scope,
    )
    server = app.state.server
    say(f"loaded {server.model_name} in {time.perf_counter() - start:.1f} s")
    say(f"tool calls are read as {server.tool_parser} ({server.tool_parser_source})")
    return app, limits


def check_outputs(llm: LLM) -> None:
    """One token from a one-token prompt: an export whose logits are NaN fails here, not per request."""
    from onnxgen.generation.params import SamplingParams

    llm.generate([llm.eos_token_ids[0] if llm.eos_token_ids else 0], SamplingParams(max_new_tokens=1))
