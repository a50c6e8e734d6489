"""The generation loop: prefill, decode steps, stopping, streaming events.

Token selection (processor chain + sampler) and text (incremental detokenizer + stop strings) are kept
apart: :class:`TokenLoop` yields token ids as the model produces them, :class:`Generator` turns them
into streamed text and a final :class:`GenerationResult`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Ids
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxgen.cache.prefix import PrefixCache
from onnxgen.engine.sequence import TextStream
from onnxgen.errors import GenerationError
from onnxgen.generation.constraints import Constraint, ConstraintCompiler
from onnxgen.generation.logprobs import TokenLogprob
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import MTP, PromptLookup, Speculative
from onnxgen.generation.token_loop import TokenLoop
from onnxgen.runtime.decode_routing import warn_once
from onnxgen.runtime.mtp_head import MTPHeadSession
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState
from onnxgen.runtime.verify_check import check_verify
from onnxgen.tokenizer import Tokenizer


@dataclass
class StreamEvent:
    """One step of a stream: the new token ids, the text they complete, and at the end a finish reason.

    ``logprobs`` (when the request asked for them) holds one :class:`TokenLogprob` per token id."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    """A finished request: the generated token ids and their text, why it ended (``finish_reason``:
    ``"stop"`` for end-of-sequence, a stop string or a completed constraint, ``"length"`` for
    ``max_new_tokens`` or the context), and ``stats`` (prompt and generated token counts, ``ttft_s``,
    ``decode_tok_s``, ...)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


# drafts a serial-attention verify holds at most: every verify carries exactly that many (padded), and its
# attention runs once per position, so wider verifies cost more than they gain on small dense models
# (docs/speculative-commit.md, "Exactness")
EXACT_VERIFY_DRAFTS = 2


class Generator:
    """Runs requests on one :class:`DecoderSession`, reusing its decode state between requests."""

    def __init__(
        self,
        session: DecoderSession,
        tokenizer: Tokenizer | None,
        eos_ids: Ids[int],
        context_length: int | None,
        final_stats: Callable[[], dict[str, Any]] | None = None,
        export: str = "the model",
        mtp_head: Callable[[], MTPHeadSession] | None = None,
        prefix_cache: PrefixCache | None = None,
        exact_speculation: bool | None = None,
        int8_activations: bool = False,
    ) -> None:
        """``final_stats`` adds entries to every request's statistics when it finishes (the LLM's decode
        plan: which plan ran the decode steps); ``export`` names the model in errors. ``mtp_head`` gives the
        model's MTP head (loaded on first use) where it has one and the session outputs the final hidden
        state."""
        self.session = session
        self.export = export
        self.mtp_head = mtp_head
        self.prefix_cache = prefix_cache
        self.final_stats = final_stats
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.context_length = context_length
        self.constraints = ConstraintCompiler(tokenizer, session.vocab_size, self.eos_ids)
        self._state: DecodeState | None = None
        self._state_lock = threading.Lock()  # requests on other threads each check out their own state
        # speculate only where a verify computes what plain steps would (EngineConfig.exact_speculation)
        self.exact_speculation = exact_speculation
        self.int8_activations = int8_activations

    def check_prompt(self, prompt_ids: Ids[int]) -> None:
        if len(prompt_ids) == 0:
            raise GenerationError("the prompt is empty; give at least one token (or non-empty text)")
        vocab = self.session.vocab_size
        bad = [int(i) for i in prompt_ids if not 0 <= int(i) < vocab] if vocab > 0 else []
        if bad:
            raise GenerationError(
                f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {vocab}); "
                "encode the prompt with this model's tokenizer"
            )
        if self.context_length is not None and len(prompt_ids) >= self.context_length:
            raise GenerationError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds {self.context_length} "
                "(prompt plus at least one new token); shorten the prompt"
            )

    def check_logit_bias(self, params: SamplingParams) -> None:
        """Raise where ``params.logit_bias`` names ids outside the model's vocabulary."""
        vocab = self.session.vocab_size
        bad = [i for i, _ in params.logit_bias_pairs if vocab > 0 and i >= vocab]
        if bad:
            raise GenerationError(
                f"logit_bias has token ids {bad[:5]} outside the model's vocabulary [0, {vocab}); "
                "give ids of this model's tokenizer"
            )

    def budget(self, prompt_len: int, params: SamplingParams, limit: int | None = None) -> SamplingParams:
        """Clip max_new_tokens to what the context (and ``limit`` tokens a sequence, where given) has room for."""
        limits = [n for n in (self.context_length, limit) if n is not None]
        if not limits or prompt_len + params.max_new_tokens <= min(limits):
            return params
        room = min(limits) - prompt_len
        return SamplingParams(
            **{**params.__dict__, "max_new_tokens": room, "min_new_tokens": min(params.min_new_tokens, room)}
        )

    def state_for(self, capacity: int) -> DecodeState:
        """A reset decode state holding at least ``capacity`` tokens, the caller's until :meth:`give_back`
        (reused between requests; a request that starts while a stream is running gets its own)."""
        with self._state_lock:
            state, self._state = self._state, None
        if state is None or state.capacity < capacity:
            return self.session.new_state(capacity)
        state.reset()
        return state

    def give_back(self, state: DecodeState) -> None:
        """Keep ``state`` for the next request (the larger one when several were out at once)."""
        with self._state_lock:
            if self._state is None or self._state.capacity < state.capacity:
                self._state = state

    def loop(
        self,
        prompt_ids: Ids[int] | np.ndarray,
        params: SamplingParams,
        speculative: Speculative | None,
        draft: Generator | None,
        constraint: Constraint | None = None,
        resume: bool = True,
    ) -> TokenLoop:
        """The loop that decodes one request alone on a state of its own (checked out: :meth:`give_back`
        it), resumed from the prefix cache where it has one (unless ``resume`` is False)."""
        state = self.state_for(len(prompt_ids) + params.max_new_tokens)
        if speculative is None:
            loop = TokenLoop(self.session, state, prompt_ids, params, self.eos_ids, constraint, self.export)
            if self.prefix_cache is not None and resume:
                loop.resume(self.prefix_cache)
            return loop
        from onnxgen.generation.speculative.loop import SpeculativeLoop
        from onnxgen.generation.speculative.mtp import MTPProposer
        from onnxgen.generation.speculative.proposers import DraftModelProposer, NgramProposer

        proposer: NgramProposer | DraftModelProposer | MTPProposer
        if isinstance(speculative, PromptLookup):
            proposer = NgramProposer(speculative.max_ngram, speculative.min_ngram)
        elif isinstance(speculative, MTP):
            head, hidden = self.mtp()
            proposer = MTPProposer(head, hidden, params, self.eos_ids, state.capacity)
        else:
            if draft is None:
                raise GenerationError("a DraftModel needs its loaded draft model")
            capacity = state.capacity
            if draft.context_length is not None:  # the draft stops drafting where its context ends
                capacity = min(capacity, draft.context_length)
            proposer = DraftModelProposer(draft.session, params, self.eos_ids, capacity)
        loop = SpeculativeLoop(
            self.session,
            state,
            prompt_ids,
            params,
            self.eos_ids,
            proposer,
            speculative.num_draft_tokens,
            speculative.adaptive,
            constraint,
            self.export,
            auto=isinstance(speculative, MTP) and speculative.auto,
        )
        # (an MTP head reads the target's hidden states of every prompt position, which a cached prefix
        # does not keep: such requests prefill the whole prompt, and still cache their reply)
        if self.prefix_cache is not None and not loop.wanted and resume:
            loop.resume(self.prefix_cache)
        return loop

    def mtp(self) -> tuple[MTPHeadSession, str]:
        """The MTP head (loaded on first use) and the decoder's hidden-state output it reads."""
        head = self.mtp_head() if self.mtp_head is not None else None  # raises where the model has none
        hidden = self.session.hidden_state
        if head is None or hidden is None:
            raise GenerationError(
                "MTP speculation needs the model's MTP head (mtp.onnx beside model.onnx) and its final "
                "hidden state; write the head with `onnxgen export-mtp CHECKPOINT_DIR MODEL_DIR`"
            )
        return head, hidden

    def speculation_off(self, speculative: Speculative | None = None) -> str | None:
        """Why speculative requests decode plainly on this model and CPU (None: they speculate).

        A verify forward computes its rows on other kernels than single decode steps on some CPUs
        (:mod:`onnxgen.runtime.verify_check`); where the graph quantizes activations to int8 (or
        ``exact_speculation=True``) and the probe finds them different, speculation would change greedy
        output, so it is off. ``exact_speculation=False`` speculates anyway."""
        wanted = self.exact_speculation
        if wanted is False or (wanted is None and not self.int8_activations):
            return None
        _ = self.session.verify_plan  # probe the graph verifies run on (a hybrid's verify plan)
        check = check_verify(self.session)
        if not check.exact and self.session.serial_width is None:
            # attention position by position in verifies of one width: exact where the rest of the graph
            # computes rows alike (probed again on the new graph)
            drafts = speculative.num_draft_tokens if speculative is not None else EXACT_VERIFY_DRAFTS
            width = 1 + min(drafts, EXACT_VERIFY_DRAFTS)
            if self.session.serialize_verifies(width) is not None:
                check = check_verify(self.session)
        if check.exact:
            return None
        why = f"a verify would change greedy output here ({check.detail})"
        warn_once(
            self.export,
            "inexact-verify",
            "speculative decoding is off for %s on this CPU: %s; requests decode plainly with the same "
            "tokens (exact_speculation=False speculates anyway)",
            self.export,
            why,
        )
        return why

    def speculation_for(self, speculative: Speculative | None) -> Speculative | None:
        """``speculative``, or None where speculation is off on this model (:meth:`speculation_off`)."""
        if speculative is None or self.speculation_off(speculative) is not None:
            return None
        return speculative

    def check_speculative(self, speculative: Speculative | None) -> None:
        """Raise, naming what is missing, where this model cannot draft with ``speculative`` (an MTP head
        absent or not fitting the model); a draft model is checked where it is loaded."""
        if isinstance(speculative, MTP):
            self.mtp()

    def stream(
        self,
        prompt_ids: Ids[int],
        params: SamplingParams,
        speculative: Speculative | None = None,
        draft: Generator | None = None,
    ) -> Iterator[StreamEvent]:
        """Events of one request; a bad prompt raises here, before the first event is asked for."""
        params, constraint = self.admit(prompt_ids, params)
        self.check_speculative(speculative)  # no MTP head, or one that does not fit the model: raises here
        return self._events(prompt_ids, params, speculative, draft, constraint)

    def admit(
        self, prompt_ids: Ids[int], params: SamplingParams, limit: int | None = None
    ) -> tuple[SamplingParams, Constraint | None]:
        """Check a request (its prompt, stop strings and constraint) before it runs: ``params`` clipped to
        the room left (:meth:`budget`) and its compiled constraint. Raises, naming what is wrong."""
        self.check_prompt(prompt_ids)
        self.check_logit_bias(params)
        if limit is not None and len(prompt_ids) >= limit:
            raise GenerationError(
                f"the prompt has {len(prompt_ids)} tokens but a batched sequence holds {limit} (prompt plus "
                "at least one new token); shorten the prompt or raise max_model_len"
            )
        if params.stop and self.tokenizer is None:
            raise GenerationError(
                f"stop strings {list(params.stop)!r} are matched on decoded text, but this model has no "
                "tokenizer; put its tokenizer.json beside model.onnx, or stop on token ids (eos) instead"
            )
        constraint = self.constraints.compile(params)  # an invalid schema/regex/grammar raises here
        return self.budget(len(prompt_ids), params, limit), constraint

    def _events(
        self,
        prompt_ids: Ids[int],
        params: SamplingParams,
        speculative: Speculative | None,
        draft: Generator | None,
        constraint: Constraint | None = None,
    ) -> Iterator[StreamEvent]:
        start = time.perf_counter()
        off = self.speculation_off(speculative) if speculative is not None else None
        loop = self.loop(prompt_ids, params, None if off else speculative, draft, constraint)
        try:  # (one generator, not two: what runs per token runs with caches the forward evicted)
            text = TextStream.of(self.tokenizer, prompt_ids, params)
            generated: list[int] = []
            first = end = start
            for token, reason in loop.tokens():
                if not generated:
                    first = time.perf_counter()
                generated.append(token)
                piece = ""
                if text is not None:
                    piece, reason = text.feed(token, reason)
                scores = None if loop.scores is None else [loop.scores[len(generated) - 1]]
                if reason is None:
                    yield StreamEvent([token], piece, logprobs=scores)
                    continue
                end = time.perf_counter()
                self.cache_reply(loop)
                stats = self._stats(len(prompt_ids), len(generated), start, first, end, loop.forward_passes)
                stats["prefill_s"] = loop.prefill_s
                stats["cached_tokens"] = loop.cached_tokens
                stats.update(loop.stats())
                if off is not None:
                    stats["speculation"] = f"off: {off}"
                if loop.constraint is not None:
                    stats.update(loop.constraint.stats())
                if self.final_stats is not None:
                    stats.update(self.final_stats())
                yield StreamEvent([token], piece, reason, stats, scores)
                return
        finally:
            self.give_back(loop.state)

    def extend_cache(self, token_ids: Ids[int], scope: str = "") -> int:
        """Run ``token_ids`` into the prefix cache: resume from their longest cached prefix, prefill the
        rest in one forward and cache the state after the last id (a chat runs the tokens its next turn
        starts with, after a reply). Returns how many ids were prefilled (0: already cached, no cache, or
        longer than the context). ``scope``: the cache partition (``SamplingParams.cache_scope``)."""
        cache = self.prefix_cache
        ids = np.asarray(token_ids, dtype=np.int64)
        if cache is None or len(ids) == 0 or cache.holds(ids, scope):
            return 0
        if self.context_length is not None and len(ids) >= self.context_length:
            return 0
        hit = cache.lookup(ids, count=False, scope=scope)
        state = self.state_for(len(ids))
        try:
            cache.restore(hit, state)
            self.session.forward(state, ids[None, hit.tokens :], 1, copy=False)
            cache.insert_state(ids, state, scope=scope)
        finally:
            self.give_back(state)
        return len(ids) - hit.tokens

    def cache_reply(self, loop: TokenLoop) -> None:
        """Cache the finished sequence: the state after its last fed token (the reply's last token was
        sampled, never fed), where the next turn of a chat resumes."""
        length = loop.state.length
        if self.prefix_cache is not None and 0 < length <= loop.n:
            self.prefix_cache.insert_state(loop.ids[:length], loop.state, scope=loop.params.cache_scope)

    @staticmethod
    def _stats(
        prompt: int, generated: int, start: float, first: float, end: float, passes: int
    ) -> dict[str, Any]:
        decode_s = end - first
        return {
            "prompt_tokens": prompt,
            "generated_tokens": generated,
            "ttft_s": first - start,
            "decode_tok_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            "forward_passes": passes,
            "total_s": end - start,
        }

    def generate(
        self,
        prompt_ids: Ids[int],
        params: SamplingParams,
        speculative: Speculative | None = None,
        draft: Generator | None = None,
    ) -> GenerationResult:
        ids: list[int] = []
        parts: list[str] = []
        scores: list[TokenLogprob] | None = [] if params.logprobs else None
        for event in self.stream(prompt_ids, params, speculative, draft):
            ids.extend(event.token_ids)
            parts.append(event.text)
            if scores is not None and event.logprobs is not None:
                scores.extend(event.logprobs)
            if event.finish_reason is not None:
                return GenerationResult(ids, "".join(parts), event.finish_reason, event.stats or {}, scores)
        raise GenerationError("generation ended without a finish reason")  # pragma: no cover
