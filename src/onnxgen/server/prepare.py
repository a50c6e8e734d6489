"""From a request body to what the scheduler runs: validation, prompt ids, per-choice sequences.

:class:`RequestPreparer` does all of a request's CPU work before decoding (JSON parsing, validation,
chat-template rendering, tokenizing, stop strings, constraint compilation): the app runs it on a worker
pool, so a huge or hostile request never stalls the event loop. Every client mistake is an
:class:`ApiError` with a 4xx status, raised here before any decoding starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from onnxgen.api.responses import effort_kwargs
from onnxgen.chat.plan import ChatPlan, plan_chat
from onnxgen.chat.tools import MAX_TOOLS
from onnxgen.errors import GenerationError, OnnxgenError
from onnxgen.generation.constraints import constraint_from_response_format
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative import MTP, DraftModel, PromptLookup, Speculative
from onnxgen.generation.speculative.spec import DEFAULT_DRAFT_TOKENS, DEFAULT_MTP_TOKENS
from onnxgen.generation.stopping import StopStrings
from onnxgen.llm import LLM
from onnxgen.server.body import parse_body
from onnxgen.server.cache_scope import DEFAULT_CACHE_SCOPE, check_cache_scope, request_cache_salt
from onnxgen.server.protocol import (
    MAX_MESSAGES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from onnxgen.server.scheduler import SchedulerConfig
from onnxgen.server.sequence import Handle, Job, SequenceRun
from onnxgen.tokenizer import Tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default of /v1/completions; chat runs to the context


def check_prompt(ids: Sequence[int], vocab: int, max_model_len: int, which: str = "the prompt") -> None:
    if not ids:
        raise GenerationError(f"{which} is empty; give non-empty text or at least one token id")
    if vocab > 0:
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise GenerationError(
                f"{which} has token ids {bad[:5]} outside the model's vocabulary [0, {vocab}); "
                "encode it with this model's tokenizer"
            )
    if len(ids) >= max_model_len:
        raise GenerationError(
            f"{which} has {len(ids)} tokens but this server's context holds {max_model_len} tokens per "
            "sequence (prompt plus at least one new token); shorten the prompt"
        )


def sampling_params(
    fields: SamplingFields,
    max_tokens: int | None,
    room: int,
    seed_offset: int,
    cache_salt: str | None = None,
) -> SamplingParams:
    """The SamplingParams of one choice; ``max_tokens`` is clipped to the ``room`` left in the context;
    ``cache_salt``: the request's prefix-cache partition (:mod:`onnxgen.server.cache_scope`)."""
    max_new = min(max_tokens if max_tokens is not None else room, room)
    response_format = fields.response_format.model_dump() if fields.response_format else None
    return SamplingParams(
        **constraint_from_response_format(response_format),
        max_new_tokens=max_new,
        temperature=fields.temperature,
        top_k=max(fields.top_k, 0),
        top_p=fields.top_p,
        min_p=fields.min_p,
        repetition_penalty=fields.repetition_penalty,
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        seed=None if fields.seed is None else fields.seed + seed_offset,
        stop=tuple(fields.stop or ()),
        ignore_eos=fields.ignore_eos,
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        min_new_tokens=min(fields.min_tokens, max_new),
        logprobs=fields.top_logprobs_count is not None,
        top_logprobs=fields.top_logprobs_count or 0,
        logprobs_mode=fields.logprobs_mode,
        logit_bias=fields.logit_bias,
        json_extra_properties=fields.json_extra_properties,
        cache_salt=cache_salt,
    )


def for_choice(
    base: SamplingParams, fields: SamplingFields, max_tokens: int | None, room: int, index: int
) -> SamplingParams:
    """``base`` (a chat plan's parameters, with its constraint) with the length and seed of choice
    ``index`` in the ``room`` its prompt leaves."""
    own = sampling_params(fields, max_tokens, room, index)
    return replace(base, max_new_tokens=own.max_new_tokens, min_new_tokens=own.min_new_tokens, seed=own.seed)


def count_messages_and_tools(body: dict[str, Any]) -> None:
    """Refuse a chat body with more messages or tools than a request may have, before they are validated
    one by one (validating ten thousand tools holds the interpreter for tens of milliseconds)."""
    for name, limit in (("messages", MAX_MESSAGES), ("tools", MAX_TOOLS)):
        items = body.get(name)
        if isinstance(items, list) and len(items) > limit:
            raise ApiError(
                400, f"{name} has {len(items)} entries; at most {limit} are accepted per request", param=name
            )


def validation_error(e: ValidationError) -> ApiError:
    """A 400 naming the first fields that failed validation."""
    message, param = _validation_message(e)
    return ApiError(400, message, param=param)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errors = e.errors(include_url=False)
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    param = ".".join(str(x) for x in errors[0]["loc"]) if errors and errors[0]["loc"] else None
    return "invalid request: " + "; ".join(parts) + more, param


@contextmanager
def client_errors() -> Iterator[None]:
    """Errors of the request's content (a bad schema, tool or template input) as 400s."""
    try:
        yield
    except RecursionError as e:  # a schema nested deeper than the JSON encoder or llguidance go
        raise ApiError(
            400, "a schema (response_format or tool parameters) nests too deeply to compile; flatten it"
        ) from e
    except (OnnxgenError, ValueError) as e:
        raise ApiError(400, str(e)) from e


@dataclass
class Prepared:
    """A request ready to queue: its prompts' ids and one :class:`SequenceRun` per prompt and choice."""

    request: ChatCompletionRequest | CompletionRequest
    prompts: list[list[int]]
    runs: list[list[SequenceRun]]
    prompt_text: Any  # for the request log: the rendered chat, or the completion prompt as given
    plan: ChatPlan | None = None  # chat: how the reply is parsed

    @property
    def choices(self) -> int:
        return sum(map(len, self.runs))

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def jobs(self, handle: Handle) -> list[Job]:
        return [Job(handle, prompt, runs) for prompt, runs in zip(self.prompts, self.runs, strict=True)]


class RequestPreparer:
    """Turns a completions or chat body into a :class:`Prepared` request (thread-safe: one per server)."""

    def __init__(
        self,
        llm: LLM,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
        model_name: str,
        tool_parser: str | None = None,
        speculative: Speculative | None = None,
        cache_scope: str = DEFAULT_CACHE_SCOPE,
    ) -> None:
        self.llm, self.tokenizer, self.config, self.model_name = llm, tokenizer, config, model_name
        self.tool_parser = tool_parser  # --tool-call-parser; None: from the chat template
        self.speculative = speculative  # --speculative: what a request drafts with unless it says
        self.cache_scope = check_cache_scope(cache_scope)  # --prefix-cache-scope

    def __call__(self, body: bytes, chat: bool, api_key: int | None = None) -> Prepared:
        """``api_key``: the index of the API key the request was let in with (None: the server has
        none), which scopes its prefix-cache use."""
        req = self._parse(parse_body(body), chat)
        if isinstance(req, ChatCompletionRequest):
            return self.chat(req, api_key)
        salt = request_cache_salt(self.cache_scope, api_key, req.cache_salt)
        with client_errors():
            prompts = self._completion_prompts(req)
            max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
            runs = self._runs(
                req, prompts, max_tokens, lambda room, i: sampling_params(req, max_tokens, room, i, salt)
            )
            return Prepared(req, prompts, runs, req.prompt)

    def chat(self, req: ChatCompletionRequest, api_key: int | None = None) -> Prepared:
        """A validated chat request planned (tools, reasoning split, constraint after the reasoning),
        tokenized and ready to queue."""
        salt = request_cache_salt(self.cache_scope, api_key, req.cache_salt)
        with client_errors():
            plan = plan_chat(
                self.tokenizer,
                [m.as_template_message() for m in req.messages],
                sampling_params(req, req.max_new, self.config.max_model_len, 0, salt),
                tools=req.tools,
                tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls,
                template_kwargs={**effort_kwargs(req.reasoning_effort), **(req.chat_template_kwargs or {})},
                tool_parser=self.tool_parser,
                literal=self.llm.generator.constraints.literal,
            )
            prompts = [self.encode(plan.prompt, "the chat prompt", add_special_tokens=False)]
            runs = self._runs(
                req, prompts, req.max_new, lambda room, i: for_choice(plan.params, req, req.max_new, room, i)
            )
            return Prepared(req, prompts, runs, plan.prompt, plan)

    def _parse(self, body: dict[str, Any], chat: bool) -> ChatCompletionRequest | CompletionRequest:
        self._count_lists(body, chat)
        try:
            req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e
        refused = req.refuse_unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0])
        self.check_model(req.model)
        if req.n > self.config.max_batch:
            raise ApiError(
                400,
                f"n={req.n} exceeds this server's batch of {self.config.max_batch} rows; lower n",
                param="n",
            )
        return req

    def check_model(self, model: str | None) -> None:
        """404 for a model name other than the one served (None: the one served)."""
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} is not served here; use {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _count_lists(self, body: dict[str, Any], chat: bool) -> None:
        """Refuse more messages or prompts than could ever be served before validating them one by one
        (validation of a few hundred thousand tiny objects would hold the interpreter for seconds)."""
        prompt = body.get("prompt")
        if chat:
            count_messages_and_tools(body)
        batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        if not chat and batch and isinstance(prompt, list) and len(prompt) > self.config.max_queue:
            raise ApiError(
                400,
                f"{len(prompt)} prompts exceed this server's queue of {self.config.max_queue}; split them",
                param="prompt",
            )

    def encode(self, text: str, which: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a text whose byte length alone proves it longer than the context is
        refused without tokenizing it."""
        floor, room = self.tokenizer.min_tokens(text), self.config.max_model_len
        if floor >= room:
            raise GenerationError(
                f"{which} is {len(text.encode('utf-8', 'surrogatepass'))} bytes, at least {floor} tokens, but "
                f"this server's context holds {room} tokens per sequence; shorten the prompt"
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompts: Sequence[str | list[int]] = req.prompts()
        out = []
        for p, prompt in enumerate(prompts):
            which = "the prompt" if len(prompts) == 1 else f"prompt {p}"
            if isinstance(prompt, str):
                if not prompt:
                    raise GenerationError(f"{which} is an empty string; give some text or token ids")
                out.append(self.encode(prompt, which))
            else:
                out.append(list(prompt))
        return out

    def _runs(
        self,
        fields: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        params_for: Callable[[int, int], SamplingParams] | None = None,
    ) -> list[list[SequenceRun]]:
        """``n`` choices per prompt; choice ``i`` of prompt ``p`` is index ``p * n + i`` and, with a
        ``seed``, samples with seed ``seed + index``. Stop strings are compiled once for all of them.
        ``params_for(room, index)``: a choice's parameters (default: from ``fields``)."""
        llm, max_len = self.llm, self.config.max_model_len
        self._check_stop_ids(fields.stop_token_ids or ())
        self._check_logit_bias(fields)
        speculative = self.speculative_for(fields)
        stops = StopStrings(fields.stop) if fields.stop else None
        out = []
        for p, prompt in enumerate(prompts):
            which = "the prompt" if len(prompts) == 1 else f"prompt {p}"
            check_prompt(prompt, llm.session.vocab_size, max_len, which)
            runs = []
            for i in range(fields.n):
                index, room = p * fields.n + i, max_len - len(prompt)
                params = (
                    params_for(room, index)
                    if params_for
                    else sampling_params(fields, max_tokens, room, index)
                )
                runs.append(self.run(index, prompt, params, stops, speculative))
            out.append(runs)
        return out

    def run(
        self,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        stops: StopStrings | None = None,
        speculative: Speculative | None = None,
    ) -> SequenceRun:
        """One choice ready to decode; its constraint is compiled here (a bad schema raises: a 400)."""
        constraint = self.llm.generator.constraints.compile(params)
        eos = self.llm.eos_token_ids
        return SequenceRun(index, prompt, params, eos, self.tokenizer, constraint, stops, speculative)

    def speculative_for(self, fields: SamplingFields) -> Speculative | None:
        """What a request drafts with: its ``speculative`` field, else the server's default."""
        asked = fields.speculative
        if asked is None:
            return self.speculative
        k, method, adaptive = asked.num_draft_tokens, asked.method, asked.adaptive
        if method == "off":
            return None
        if method == "prompt-lookup":
            return PromptLookup(k or DEFAULT_DRAFT_TOKENS, adaptive=adaptive)
        if method in ("mtp", "mtp-always"):
            try:
                self.llm.generator.check_speculative(MTP())
            except OnnxgenError as e:
                raise ApiError(400, str(e), param="speculative.method") from e
            return MTP(k or DEFAULT_MTP_TOKENS, auto=method == "mtp", adaptive=adaptive)
        if not isinstance(self.speculative, DraftModel):
            raise ApiError(
                400,
                "this server has no draft model; ask for prompt-lookup or mtp, or start the server with "
                "--speculative draft:PATH",
                param="speculative.method",
            )
        return replace(
            self.speculative, num_draft_tokens=k or self.speculative.num_draft_tokens, adaptive=adaptive
        )

    def _check_logit_bias(self, fields: SamplingFields) -> None:
        if not fields.logit_bias:
            return
        try:
            self.llm.generator.check_logit_bias(SamplingParams(logit_bias=fields.logit_bias))
        except OnnxgenError as e:
            raise ApiError(400, str(e), param="logit_bias") from e

    def _check_stop_ids(self, ids: Sequence[int]) -> None:
        vocab = self.llm.session.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ApiError(
                400,
                f"stop_token_ids has ids {bad[:5]} outside the model's vocabulary [0, {vocab}); "
                "give ids of this model's tokenizer",
                param="stop_token_ids",
            )
