"""LLM: what :func:`onnxgen.load` returns. Ties package, session, tokenizer and generator together."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, overload

import numpy as np

from onnxgen.cache.prefix import PrefixCache
from onnxgen.chat.continuation import next_turn_prefix
from onnxgen.chat.deltas import ChatDelta
from onnxgen.chat.messages import check_messages
from onnxgen.chat.output import ChatOutput
from onnxgen.chat.plan import ChatPlan, plan_chat
from onnxgen.chat.tools import ToolCall
from onnxgen.config import EngineConfig
from onnxgen.engine.batch_run import run_batch
from onnxgen.engine.engine import Engine
from onnxgen.engine.limits import BatchLimits
from onnxgen.errors import GenerationError, TokenizerError
from onnxgen.generation.generator import GenerationResult, Generator, StreamEvent
from onnxgen.generation.params import SAMPLING_FIELDS, SamplingParams, resolve_params
from onnxgen.generation.speculative import DraftModel, Speculative
from onnxgen.graph.hybrid_ops import int8_activations
from onnxgen.model import ModelPackage
from onnxgen.model.mtp import mtp_head_io
from onnxgen.model.sources import resolve_model
from onnxgen.prepare import prepare
from onnxgen.runtime.mtp_head import MTPHeadSession
from onnxgen.runtime.session import default_threads
from onnxgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]

DEFAULT_MODEL_DIR = Path(__file__).parent / "data" / "default_model"


def default_model_dir() -> Path:
    """The small model bundled with onnxgen (used when no model is given)."""
    return DEFAULT_MODEL_DIR


class LLM:
    """A loaded decoder export, ready to generate: what :func:`load` returns.

    :meth:`generate` / :meth:`stream` complete a prompt (text or token ids); :meth:`chat` /
    :meth:`stream_chat` answer a conversation through the model's chat template, with tools and reasoning.
    Each takes a :class:`~onnxgen.SamplingParams` or its fields as keywords.

    ``LLM("path/to/model")`` (or ``LLM(model="path")``, as vLLM spells it) loads as :func:`load` does,
    engine settings by name included.
    """

    def __init__(
        self,
        package: ModelPackage | str | Path | None = None,
        config: EngineConfig | None = None,
        *,
        chat_template: str | None = None,
        **settings: Any,
    ) -> None:
        if "model" in settings:
            if package is not None:
                raise TypeError("LLM() got the model twice (positionally and as model=); pass it once")
            package = settings.pop("model")
        if not isinstance(package, ModelPackage):  # a path or name (None: the bundled model), as load() takes
            config = (config if config is not None else EngineConfig.from_env()).replace(**settings)
            package = ModelPackage.open(
                resolve_model(package) if package is not None else default_model_dir()
            )
        elif settings:
            config = (config if config is not None else EngineConfig()).replace(**settings)
        self.package = package
        self.io = package.io
        self.config = config = config if config is not None else EngineConfig()
        self._mtp: MTPHeadSession | None = None
        self._mtp_lock = threading.Lock()
        self._providers = config.providers
        tokenizer = _TokenizerLoad(package)
        try:
            self.prepared = prepared = prepare(package, config)
            self.decode_plan = prepared.decode
            # an MTP head beside the model: the session also outputs the final hidden state the head reads
            self.mtp_path, self._mtp_missing = prepared.mtp.path, prepared.mtp.missing
            self.session = prepared.open_session(before_initialize=tokenizer.start)
        except BaseException:
            tokenizer.cancel()
            raise
        self.tokenizer: Tokenizer | None = tokenizer.result()
        if chat_template is not None:
            self._require_tokenizer().use_chat_template(chat_template)
        eos = package.eos_token_ids or (self.tokenizer.eos_token_ids if self.tokenizer else ())
        if not eos:
            log.warning(
                "%s names no end-of-sequence token (no config states one and tokenizer.json has none of "
                "the usual end-of-text tokens): generation stops only at max_new_tokens or a stop string; "
                "SamplingParams(stop_token_ids=[...]) adds tokens to stop at",
                package.root,
            )
        self.generator = Generator(
            self.session,
            self.tokenizer,
            eos,
            package.context_length,
            final_stats=lambda: {"decode_plan": self.decode_plan.plan.name},  # which plan ran the steps
            export=f"the export {package.model_path}",
            mtp_head=self.mtp_head,  # raises, naming what is missing, where there is no usable head
            prefix_cache=PrefixCache.from_mb(self.io, config.prefix_cache_mb, config.checkpoint_interval),
            exact_speculation=config.exact_speculation,
            int8_activations=int8_activations(package.graph),
        )
        package.release_graph()
        if config.speculative and self.mtp_path is not None:
            self.mtp_head()  # at load, not inside the first MTP request
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._drafts: dict[str, LLM] = {}
        self._checked_drafts: set[LLM] = set()

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The model's prefix cache (None when ``prefix_cache_mb`` is 0)."""
        return self.generator.prefix_cache

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The token ids that end a request (from the model's configs or its tokenizer)."""
        return self.generator.eos_ids

    # -- prompts ----------------------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(
                f"{self.package.root} has no tokenizer.json, so text prompts cannot be encoded; "
                "pass token ids, or put the model's tokenizer.json beside model.onnx"
            )
        return self.tokenizer

    def encode(self, prompt: Prompt, where: str = "generate") -> list[int]:
        """Token ids of ``prompt``: text is tokenized with the model's tokenizer, ids are passed through.
        Anything else (messages, a list of prompts where one is taken) raises, naming the call that takes
        it (``where`` is the call that got it)."""
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("the prompt is empty; give non-empty text or token ids")
            return self._require_tokenizer().encode(prompt)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise GenerationError(
                "the prompt is bytes, not text or token ids; decode it first (prompt.decode('utf-8'))"
            )
        _check_ids(prompt, where)
        return [int(i) for i in prompt]

    def chat_prompt(self, messages: Messages, **template_kwargs: Any) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template, ready for the assistant's turn
        (``template_kwargs``: template variables such as ``enable_thinking``)."""
        tok = self._require_tokenizer()
        check_messages(messages)
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        return tok.encode(text, add_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (for log-probability bodies; may be part of a character)."""
        self._require_tokenizer()
        return self.generator.constraints.token_bytes(token_id)

    # -- speculative decoding -----------------------------------------------------------------------
    def mtp_head(self) -> MTPHeadSession:
        """The model's MTP head session (checked against the decoder), loaded with the model when
        ``EngineConfig.speculative`` is set, else on first use."""
        with self._mtp_lock:
            if self._mtp is None:
                if self.mtp_path is None:
                    raise GenerationError(self._mtp_missing)
                # one thread: a head forward (one layer over a few tokens) gains nothing from a second,
                # whose pool would spin after each forward on a core the target needs; an int4 lm_head:
                # cheaper drafts, the output unchanged (docs/speculative-mtp.md, "Cost on the bundled model")
                head = MTPHeadSession(
                    mtp_head_io(self.package, self.mtp_path),
                    threads=1,
                    providers=self._providers,
                    int4_lm_head=True,
                )
                port = next(
                    (o for o in self.session.current().get_outputs() if o.name == self.session.hidden_state),
                    None,
                )
                size = port.shape[-1] if port is not None else None
                if head.vocab_size != self.session.vocab_size or (
                    isinstance(size, int) and size != head.hidden_size
                ):
                    raise GenerationError(
                        f"{self.mtp_path} does not fit {self.package.model_path}: the head has vocabulary "
                        f"{head.vocab_size} and hidden size {head.hidden_size}, the decoder {self.session.vocab_size} "
                        f"and {size}; export the head from the checkpoint of this model"
                    )
                self._mtp = head
            return self._mtp

    def draft_generator(self, speculative: Speculative | None) -> Generator | None:
        """The generator of a :class:`~onnxgen.DraftModel`'s draft (loaded on first use and checked against
        this model's tokenizer); None for other kinds of speculation."""
        if not isinstance(speculative, DraftModel):
            return None
        draft = speculative.model
        if not isinstance(draft, LLM):
            key = os.path.abspath(resolve_model(draft))  # links kept: a hub cache's files are links
            if key not in self._drafts:
                self._drafts[key] = load(key, threads=draft_threads(self.session.threads))
            draft = self._drafts[key]
        self._check_same_tokenizer(draft)
        return draft.generator

    def check_speculative(self, speculative: Speculative | None) -> None:
        """Raise, naming what is missing, where this model cannot draft with ``speculative`` (no usable MTP
        head; a draft model that does not load or does not share the tokenizer: it is loaded here)."""
        self.generator.check_speculative(speculative)
        self.draft_generator(speculative)

    def _check_same_tokenizer(self, draft: LLM) -> None:
        if draft in self._checked_drafts:
            return
        where = f"draft model {draft.package.root}"
        if draft.session.vocab_size != self.session.vocab_size:
            raise GenerationError(
                f"{where} has a vocabulary of {draft.session.vocab_size} logits but the target has "
                f"{self.session.vocab_size}; a draft model must share the target's tokenizer"
            )
        if self.tokenizer is not None and draft.tokenizer is not None:
            probe = "def main():\n    return 'Hello, world!'  # 42 ünïcode"
            if self.tokenizer.encode(probe) != draft.tokenizer.encode(probe):
                raise GenerationError(
                    f"{where} tokenizes text differently from the target; a draft model must share the "
                    "target's tokenizer (export both from checkpoints with the same tokenizer.json)"
                )
        self._checked_drafts.add(draft)

    # -- generation -------------------------------------------------------------------------------
    @overload
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        speculative: Speculative | None = None,
        **sampling: Any,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        prompt: list[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: Speculative | None = None,
        **sampling: Any,
    ) -> list[GenerationResult]: ...

    def generate(
        self,
        prompt: Prompt | list[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: Speculative | None = None,
        **sampling: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Complete ``prompt`` (text, or token ids) and return the whole result; given a list of prompts,
        their results in the same order, decoded together as a continuous batch (:meth:`generate_batch`).

        ``params`` says how to sample and when to stop; its fields may be given as keywords instead
        (``llm.generate("hi", max_new_tokens=5, temperature=0.7)``; not both). Defaults: greedy, 64 new
        tokens. ``speculative`` (:class:`~onnxgen.PromptLookup`, :class:`~onnxgen.DraftModel`,
        :class:`~onnxgen.MTP`) drafts tokens that one forward verifies: greedy output is unchanged, sampled
        output keeps its distribution. Raises :class:`~onnxgen.OnnxgenError` subclasses on bad input.
        """
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int | np.integer):
            if _is_messages(prompt):
                raise GenerationError(
                    "generate() takes prompts (text or token ids), not messages; answer a conversation "
                    "with llm.chat(messages) (llm.stream_chat to stream it)"
                )
            if isinstance(params, SamplingParams | None):
                params = resolve_params(params, sampling, "generate")
            elif sampling:
                raise TypeError("generate() got a list of params and sampling keywords; pass one of them")
            return self.generate_batch(prompt, params, speculative)
        if not isinstance(params, SamplingParams | None):
            raise GenerationError(
                "one prompt takes one SamplingParams; give a list of prompts for a list of them"
            )
        resolved = resolve_params(params, sampling, "generate")
        draft = self.draft_generator(speculative)
        single = cast(Prompt, prompt)
        return self.generator.generate(self.encode(single), resolved, speculative, draft)

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: Speculative | None = None,
    ) -> list[GenerationResult]:
        """The completions of ``prompts``, in their order, decoded as a continuous batch through the
        :class:`~onnxgen.engine.engine.Engine` (rows join as others finish, up to ``max_batch`` at once).

        ``params``: one for every prompt, or a list with one per prompt. Every prompt is checked before
        any runs; a prompt that fails while decoding (its constraint, say) ends with finish reason
        ``"error"`` and the message in ``stats["error"]``, and the others go on. Each sequence gets the
        tokens it gets alone (rows never depend on their company). With ``speculative`` every prompt
        drafts and verifies on its own, beside the others (the tokens :meth:`generate` gives it)."""
        many = (
            [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
        )
        if len(many) != len(prompts):
            raise GenerationError(
                f"{len(many)} SamplingParams for {len(prompts)} prompts; give one per prompt"
            )
        with self._engine_lock:
            engine = self.engine()
            ids = [self.encode(p) for p in prompts]
            for prompt_ids, p in zip(ids, many, strict=True):  # every request checked before any runs
                self.generator.admit(prompt_ids, p, engine.limits.max_model_len)
            engine.lanes.check(speculative)
            return run_batch(engine, ids, many, speculative)

    def engine(self) -> Engine:
        """The batching engine on this model's session, made on first use (its limits from ``config``)."""
        if self._engine is None:
            limits = BatchLimits.resolve(self.config, self.package, self.session)
            self._engine = Engine(self.generator, limits, self.draft_generator)
        return self._engine

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        speculative: Speculative | None = None,
        **sampling: Any,
    ) -> Iterator[StreamEvent]:
        """:meth:`generate`, as events: each carries the new token ids and the text they complete; the last
        has the ``finish_reason`` and the ``stats``."""
        params = resolve_params(params, sampling, "stream")
        ids = self.encode(prompt, "stream")
        draft = self.draft_generator(speculative)
        return self.generator.stream(ids, params, speculative, draft)

    def plan_chat(self, messages: Messages, params: SamplingParams | None = None, **options: Any) -> ChatPlan:
        """The prompt, sampling parameters and reply parser of a chat request (options: see :meth:`chat`)."""
        tokenizer = self._require_tokenizer()
        check_messages(messages)
        template_kwargs = options.pop("chat_template_kwargs", None)
        return plan_chat(
            tokenizer,
            messages,
            params or SamplingParams(),
            template_kwargs=template_kwargs,
            literal=self.generator.constraints.literal,
            **options,
        )

    @overload
    def chat(
        self,
        messages: Messages,
        params: SamplingParams | None = None,
        speculative: Speculative | None = None,
        **options: Any,
    ) -> ChatResult: ...

    @overload
    def chat(
        self,
        messages: list[Messages],
        params: SamplingParams | None = None,
        speculative: Speculative | None = None,
        **options: Any,
    ) -> list[ChatResult]: ...

    def chat(
        self,
        messages: Messages | list[Messages],
        params: SamplingParams | None = None,
        speculative: Speculative | None = None,
        **options: Any,
    ) -> ChatResult | list[ChatResult]:
        """Reply to ``messages`` (OpenAI-style dicts: ``role``, ``content``, ``tool_calls``, ...): the text,
        and parsed from it the answer, the reasoning and tool calls. Given a list of conversations (as
        vLLM's ``LLM.chat`` takes), their replies in the same order, decoded together as a continuous
        batch (each the tokens it gets alone; no turn is cached for the next).

        ``params`` and ``speculative`` as for :meth:`generate`; SamplingParams fields may be given as
        keywords instead of ``params``. Chat options: ``tools`` (OpenAI function tools), ``tool_choice``
        (``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``),
        ``parallel_tool_calls`` (default True), ``chat_template_kwargs`` (template variables such as
        ``enable_thinking``), ``tool_parser`` (``"hermes"`` or ``"qwen3_coder"``; default: from the
        template), ``reasoning`` (split ``<think>`` sections; default: when the template writes them),
        ``constrain_calls`` (default True: ``"auto"`` replies are grammar-constrained too). See
        :mod:`onnxgen.chat.plan`. ``cache_turn`` (default True; only with a prefix cache): after the reply,
        run the tokens the next turn starts with once ``{"role": "assistant", "content": result.text}``
        is appended (the reply as the template renders it, its end-of-turn tokens) into the prefix cache,
        so the next turn prefills its new message only; the model is fed the same tokens either way.
        """
        params, options = _split_chat_keywords(params, options, "chat")
        cache_turn = bool(options.pop("cache_turn", True))
        if _is_conversations(messages):
            conversations = cast(list[Messages], messages)
            plans = [self.plan_chat(c, params, **options) for c in conversations]
            ids = [self._chat_ids(plan) for plan in plans]
            results = self.generate_batch(ids, [plan.params for plan in plans], speculative)
            return [_chat_result(plan, r) for plan, r in zip(plans, results, strict=True)]
        one = cast(Messages, messages)
        template_kwargs = options.get("chat_template_kwargs")
        plan = self.plan_chat(one, params, **options)
        draft = self.draft_generator(speculative)
        result = self.generator.generate(self._chat_ids(plan), plan.params, speculative, draft)
        if cache_turn:
            self._cache_turn(one, plan, template_kwargs, result.text, result.stats)
        return _chat_result(plan, result)

    def stream_chat(
        self,
        messages: Messages,
        params: SamplingParams | None = None,
        speculative: Speculative | None = None,
        **options: Any,
    ) -> Iterator[ChatStreamEvent]:
        """:meth:`chat` streamed: each event carries the parsed ``deltas`` its text completes; the last
        one also the whole parsed ``output``. Takes what :meth:`chat` takes."""
        params, options = _split_chat_keywords(params, options, "stream_chat")
        if _is_conversations(messages):
            raise GenerationError(
                "stream_chat() takes one conversation; reply to a list of them with llm.chat(conversations) "
                "(a continuous batch), or stream each in turn"
            )
        cache_turn = bool(options.pop("cache_turn", True))
        template_kwargs = options.get("chat_template_kwargs")
        plan = self.plan_chat(messages, params, **options)
        draft = self.draft_generator(speculative)
        events = self.generator.stream(self._chat_ids(plan), plan.params, speculative, draft)

        def after(text: str, stats: dict[str, Any]) -> None:
            if cache_turn:
                self._cache_turn(messages, plan, template_kwargs, text, stats)

        return _chat_events(plan, events, after)

    def _chat_ids(self, plan: ChatPlan) -> list[int]:
        return self._require_tokenizer().encode(plan.prompt, add_special_tokens=False)

    def _cache_turn(
        self,
        messages: Messages,
        plan: ChatPlan,
        template_kwargs: Mapping[str, Any] | None,
        text: str,
        stats: dict[str, Any],
    ) -> None:
        """With a prefix cache: run the tokens the next turn starts with once ``{"role": "assistant",
        "content": text}`` is appended (the reply as the template renders it, its end-of-turn tokens, the
        next message's header) into the cache, so that turn prefills its new message only
        (:mod:`onnxgen.chat.continuation`). Adds ``next_turn_prefill_tokens`` and ``next_turn_prefill_s``
        to ``stats``."""
        if self.prefix_cache is None:
            return
        start = time.perf_counter()
        reply = {"role": "assistant", "content": text}
        try:
            ids = next_turn_prefix(self._require_tokenizer(), messages, reply, plan.tools, template_kwargs)
        except TokenizerError as e:  # a template that refuses the continued conversation: nothing to cache
            log.debug("the next turn's prefix is not cached: %s", e)
            return
        stats["next_turn_prefill_tokens"] = self.generator.extend_cache(ids, plan.params.cache_scope)
        stats["next_turn_prefill_s"] = time.perf_counter() - start


@dataclass
class ChatResult(GenerationResult):
    """A chat reply: :class:`GenerationResult` plus the answer, the reasoning and the tool calls parsed
    from ``text`` (``finish_reason`` is ``"tool_calls"`` when a reply that ended on its own made calls)."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChatStreamEvent(StreamEvent):
    """A :class:`StreamEvent` with the parsed pieces of its text; the last event has ``output``."""

    deltas: list[ChatDelta] = field(default_factory=list)
    output: ChatOutput | None = None


CHAT_OPTIONS = frozenset(
    (
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "tool_parser",
        "reasoning",
        "constrain_calls",
        "cache_turn",
    )
)


def _chat_result(plan: ChatPlan, result: GenerationResult) -> ChatResult:
    output = plan.parse(result.text)
    return ChatResult(
        result.token_ids,
        result.text,
        plan.finish_reason(result.finish_reason, output),
        result.stats,
        result.logprobs,
        content=output.content,
        reasoning=output.reasoning,
        tool_calls=output.tool_calls,
    )


def _is_messages(items: Sequence[Any]) -> bool:
    """A list of chat messages (``{"role": ..., "content": ...}`` dicts)."""
    return bool(items) and all(isinstance(m, Mapping) for m in items)


def _is_conversations(items: Any) -> bool:
    """A list of conversations (each a list of messages), as vLLM's ``LLM.chat`` takes."""
    return (
        isinstance(items, Sequence)
        and bool(items)
        and all(isinstance(c, Sequence) and not isinstance(c, str) and _is_messages(c) for c in items)
    )


def _check_ids(prompt: Any, where: str) -> None:
    """Raise, naming the right call, where ``prompt`` is no sequence of token ids."""
    if isinstance(prompt, Mapping) or (isinstance(prompt, Sequence) and _is_messages(prompt)):
        raise GenerationError(
            f"{where}() takes a prompt (text or token ids), not chat messages; answer a conversation with "
            "llm.chat(messages) or llm.stream_chat(messages)"
        )
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        raise GenerationError(
            f"{where}() takes one prompt, not a list of {len(prompt)}; llm.generate([...]) decodes a list "
            f"as one continuous batch (or call {where}() once per prompt)"
        )
    if not isinstance(prompt, Sequence | np.ndarray) or not all(
        isinstance(i, int | np.integer) and not isinstance(i, bool) for i in prompt
    ):
        raise GenerationError(
            f"{where}() takes a prompt as text or a sequence of token ids (ints); got {type(prompt).__name__}"
        )


def _split_chat_keywords(
    params: SamplingParams | None, keywords: Mapping[str, Any], where: str
) -> tuple[SamplingParams, dict[str, Any]]:
    """A chat call's keywords: chat options, and SamplingParams fields (instead of ``params``)."""
    options = {k: v for k, v in keywords.items() if k in CHAT_OPTIONS}
    sampling = {k: v for k, v in keywords.items() if k not in CHAT_OPTIONS}
    try:
        return resolve_params(params, sampling, where), options
    except TypeError as e:
        if set(sampling) - SAMPLING_FIELDS - {"max_tokens"}:  # name the chat options too
            raise TypeError(f"{e}; chat options: {', '.join(sorted(CHAT_OPTIONS))}") from None
        raise


def _chat_events(
    plan: ChatPlan,
    events: Iterator[StreamEvent],
    after: Callable[[str, dict[str, Any]], None] | None = None,
) -> Iterator[ChatStreamEvent]:
    """The chat events of ``events``; ``after(text, stats)`` runs once the last one was taken (the
    reply's whole text, the last event's stats, which it may add to)."""
    parser = plan.stream()
    parts: list[str] = []
    for event in events:
        parts.append(event.text)
        deltas = parser.feed(event.text)
        output = None
        reason = event.finish_reason
        if reason is not None:
            deltas += parser.finish()
            output = parser.output
            reason = plan.finish_reason(reason, output)
        yield ChatStreamEvent(
            event.token_ids, event.text, reason, event.stats, event.logprobs, deltas=deltas, output=output
        )
        if reason is not None and after is not None:
            after("".join(parts), event.stats if event.stats is not None else {})


class _TokenizerLoad:
    """The package's tokenizer (None without ``tokenizer.json``) and its token settings, loaded on another
    thread from when :meth:`start` is called.

    The tokenizers library holds the GIL for the whole parse of ``tokenizer.json`` (0.2 s for a 2 MB file,
    more for a 150k vocabulary), so a parse beside the load's own Python holds that Python up by as much.
    The load calls :meth:`start` just before onnxruntime initializes the session, which is most of a load
    and runs with the GIL released: the parse then costs the load nothing while it is shorter."""

    def __init__(self, package: ModelPackage) -> None:
        self._go = threading.Event()
        self._wanted = True
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="onnxgen-load")
        self._future = self._pool.submit(self._load, package)

    def _load(self, package: ModelPackage) -> Tokenizer | None:
        self._go.wait()
        if not self._wanted:
            return None
        package.settings  # noqa: B018 - resolved here, off the loading thread's path
        if package.tokenizer_path is None:
            return None
        return Tokenizer.from_dir(package.root, package.tokenizer_backend)

    def start(self) -> None:
        self._go.set()

    def result(self) -> Tokenizer | None:
        """The tokenizer (started now if it was not), or what its loading raised."""
        self.start()
        try:
            return self._future.result()
        finally:
            self._pool.shutdown()

    def cancel(self) -> None:
        """Give up the tokenizer (the load failed): the thread ends without parsing, if it has not begun."""
        self._wanted = False
        self.start()
        self._pool.shutdown(wait=False)


def draft_threads(target_threads: int) -> int:
    """Intra-op threads for a draft model loaded beside a target that uses ``target_threads``.

    The draft runs between the target's forwards, and the target's thread pool spins for a while after
    each of them: a draft whose own pool needs those cores makes both wait (docs/benchmarks.md). So the
    draft gets the cores the target leaves, plus the calling thread.
    """
    return max(1, default_threads() - target_threads + 1)


def load(
    model: str | Path | None = None,
    config: EngineConfig | None = None,
    *,
    chat_template: str | None = None,
    **overrides: Any,
) -> LLM:
    """Open a model (or the bundled default model when ``model`` is None) and get it ready.

    ``model`` is a model directory, a ``.onnx`` or ``.gguf`` file (converted once into a cache), a name
    given to ``onnxgen pull`` or a Hugging Face hub id in the local hub cache
    (:func:`onnxgen.model.sources.resolve_model`). ``chat_template``: the text of a chat template that
    replaces the model's own (a Jinja template as in ``tokenizer_config.json``).

    The engine's settings are ``config`` (default: :meth:`EngineConfig.from_env`, the environment's
    ``ONNXGEN_*`` settings) with ``overrides`` on top: any :class:`~onnxgen.config.EngineConfig` field by
    name (``threads``, ``providers``, ``decode_plan``, ``huge_pages``, ``speculative``, ``fast_ops``,
    ``fuse``, ``prefix_cache_mb``, ...), None meaning "not given". A bad name or value raises
    :class:`~onnxgen.errors.SettingError` naming it.
    """
    return LLM(model, config, chat_template=chat_template, **overrides)
