"""Per-request sampling parameters: one frozen, validated dataclass.

``temperature=0`` means greedy decoding (the OpenAI convention). Every invalid value raises
:class:`SamplingParamsError` (a ``ValueError`` and a :class:`~onnxgen.errors.GenerationError`) whose message
follows one template: the parameter, the constraint, the value given, a hint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, TypeGuard, cast

from onnxgen.errors import GenerationError


class SamplingParamsError(GenerationError, ValueError):
    """A sampling parameter is out of range or of the wrong type. Raised by a field check, it also says
    which: ``param`` must be ``constraint`` (got ``value``); ``hint`` says how to fix it (the command line
    rewords these in flag names)."""

    def __init__(
        self, message: str, param: str = "", constraint: str = "", value: object = None, hint: str = ""
    ) -> None:
        super().__init__(message)
        self.param, self.constraint, self.value, self.hint = param, constraint, value, hint


def _invalid(name: str, constraint: str, value: object, hint: str) -> SamplingParamsError:
    return SamplingParamsError(
        f"{name} must be {constraint} (got {value!r}); {hint}", name, constraint, value, hint
    )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _check_int(name: str, value: object, low: int, hint: str) -> None:
    if not _is_int(value) or value < low:
        raise _invalid(name, f"an integer >= {low}", value, hint)


def _check_float(name: str, value: object, low: float, high: float, constraint: str, hint: str) -> None:
    if not _is_number(value) or not low <= value <= high:
        raise _invalid(name, constraint, value, hint)


def _normalize_stop(stop: object) -> tuple[str, ...]:
    items = (stop,) if isinstance(stop, str) else stop
    hint = "pass a string or a list of non-empty strings"
    if not isinstance(items, Sequence):
        raise _invalid("stop", "a string or a list of strings", stop, hint)
    for item in items:
        if not isinstance(item, str) or not item:
            raise _invalid("stop", "a list of non-empty strings", stop, hint)
    return tuple(items)


DEFAULT_MAX_NEW_TOKENS = 64
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "tool_grammar")
LOGPROBS_MODES = ("raw", "processed")
MAX_TOP_LOGPROBS = 20
# below these, dividing logits by the temperature or the penalty overflows float32 (inf, then NaN)
MIN_TEMPERATURE = 1e-5  # (vLLM's sampling epsilon)
MIN_REPETITION_PENALTY = 1e-3


def _normalize_logit_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    """``{token_id: bias}`` (ids as ints or, as OpenAI's JSON sends them, digit strings) or ``(id, bias)``
    pairs, returned as sorted pairs; None or empty: no bias."""
    if bias is None:
        return None
    hint = f"pass {{token_id: bias}} with ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    items = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes)):
        raise _invalid("logit_bias", "a mapping of token ids to biases", bias, hint)
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, Sequence) or len(item) != 2:
            raise _invalid("logit_bias", "a mapping of token ids to biases", bias, hint)
        key, value = item
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token) or token < 0:
            raise _invalid("logit_bias", "keyed by token ids >= 0", key, hint)
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise _invalid(
                f"logit_bias[{token}]", f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", value, hint
            )
        out[int(token)] = float(value)
    return tuple(sorted(out.items())) or None


@dataclass(frozen=True)
class ReasoningSection:
    """A reasoning section at the start of the output (``start`` ... ``end``), which a constraint leaves
    free: the constraint applies to the text after ``end``. ``opened``: the prompt opened the section, so
    the output starts inside it (Qwen3.5); otherwise the output may open it itself or skip it (Qwen3)."""

    opened: bool = False
    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise _invalid(f"reasoning_section.{name}", "a non-empty string", value, "give the tag text")
        if not isinstance(self.opened, bool):
            raise _invalid("reasoning_section.opened", "a bool", self.opened, "use True or False")


def _normalize_schema(schema: object) -> str:
    """A JSON schema given as a mapping, as JSON text or as a Pydantic model (its class or an instance:
    its ``model_json_schema()``), returned as JSON text."""
    hint = (
        "pass a JSON object such as {'type': 'object', 'properties': {...}} (a dict or its JSON text), "
        "or a Pydantic model class"
    )
    to_schema = getattr(schema, "model_json_schema", None)
    if callable(to_schema):
        schema = to_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _invalid(
                "json_schema", "a JSON object", schema, f"the text is not JSON ({e}); {hint}"
            ) from e
    if not isinstance(schema, Mapping):
        raise _invalid("json_schema", "a JSON object", schema, hint)
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _invalid("json_schema", "JSON-serializable", schema, f"{e}; {hint}") from e


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_new_tokens: most tokens to generate (finish reason ``"length"`` when reached).
        temperature: softmax temperature; ``0`` selects greedy decoding.
        top_k: keep the k most likely tokens (``0`` disables).
        top_p: nucleus sampling mass in (0, 1] (``1.0`` disables).
        min_p: drop tokens whose probability is below ``min_p`` times the top probability (``0`` disables).
        repetition_penalty: HF-style penalty over prompt and generated tokens (``1.0`` disables).
        presence_penalty: OpenAI-style penalty in [-2, 2] over generated tokens.
        frequency_penalty: OpenAI-style penalty in [-2, 2] per occurrence in generated tokens.
        seed: seed of the request's random generator; ``None`` draws from OS entropy.
        stop: stop strings; a single string is accepted and stored as a one-element tuple.
        ignore_eos: keep generating past end-of-sequence tokens.
        stop_token_ids: more token ids that end the request as end-of-sequence does (e.g. where the model
            package names none, or a chat model's end-of-turn token); unlike eos they stop even with
            ``ignore_eos``.
        min_new_tokens: end-of-sequence tokens are masked until this many tokens were generated.
        json_schema: constrain the output to JSON valid under this schema (a dict, JSON text or a Pydantic
            model class; stored as JSON text). At most one of ``json_schema``, ``regex``, ``grammar`` may be given.
        regex: constrain the output to match this regular expression in full (Rust ``regex`` syntax).
        grammar: constrain the output to this Lark grammar (llguidance's Lark dialect, rule ``start``).
            A constrained request ends with finish reason ``"stop"`` as soon as the constraint is complete;
            see :mod:`onnxgen.generation.constraints`.
        tool_grammar: a Lark grammar of tool calls, as :func:`onnxgen.chat.grammar.tool_call_grammar` builds
            it from a request's tools (``LLM.chat`` sets it); constrains like ``grammar``.
        reasoning_section: the output starts with (or may start with) a reasoning section that the
            constraint leaves free (:class:`ReasoningSection`); without a constraint it has no effect.
        logprobs: report the log-probability of each generated token (``GenerationResult.logprobs``,
            ``StreamEvent.logprobs``).
        logit_bias: ``{token_id: bias}`` added to the model's logits before every other processor
            (OpenAI semantics: a bias in [-100, 100]; -100 in effect bans a token, 100 in effect forces it);
            token ids may be ints or digit strings. Stored as sorted ``(id, bias)`` pairs.
        json_extra_properties: read ``json_schema`` (and tool parameter schemas) as JSON Schema does: an
            object that says nothing of ``additionalProperties`` may hold keys it does not list. Default
            False: OpenAI's structured-output reading, only the listed properties
            (:mod:`onnxgen.generation.schema_objects`).
        max_tokens: vLLM's and OpenAI's name of ``max_new_tokens``, accepted when constructing (stored as
            ``max_new_tokens``; giving both with different values is an error).
        top_logprobs: also report the ``top_logprobs`` most likely tokens at each step (0 to 20; needs
            ``logprobs``).
        logprobs_mode: ``"raw"`` (default, as vLLM): the model's distribution, the log-softmax of its
            logits before penalties, masks and temperature; ``"processed"``: the distribution the token was
            chosen from, after the processor chain (penalties, constraint mask, and when sampling
            temperature and top-k/top-p/min-p), where masked tokens have ``-inf``.
        detokenize: stream text beside the token ids (``False``: events and results carry token ids
            and empty text, and no time goes to detokenizing, as vLLM's ``detokenize=False``; stop
            strings, which are matched on text, need it).
        cache_salt: the prefix-cache partition of the request (vLLM's ``cache_salt``): cached prefixes
            are shared only among requests with the same salt (``None``: among those without one), so a
            request cannot tell from a cache hit what another salt's prompts held.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = field(default_factory=tuple)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | list[int] = ()
    min_new_tokens: int = 0
    json_schema: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    tool_grammar: str | None = None
    reasoning_section: ReasoningSection | None = None
    detokenize: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"
    logit_bias: Mapping[int, float] | Mapping[str, float] | Sequence[tuple[int, float]] | None = None
    json_extra_properties: bool = False
    cache_salt: str | None = None
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens: int | None) -> None:
        if max_tokens is not None:
            if self.max_new_tokens not in (DEFAULT_MAX_NEW_TOKENS, max_tokens):
                raise _invalid(
                    "max_tokens",
                    f"equal to max_new_tokens ({self.max_new_tokens}) when both are given",
                    max_tokens,
                    "they are one setting: give max_new_tokens or max_tokens (vLLM's name)",
                )
            object.__setattr__(self, "max_new_tokens", max_tokens)
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        self._check_lengths()
        self._check_sampling()
        self._check_penalties()
        if self.seed is not None:
            _check_int("seed", self.seed, 0, "use a non-negative integer, or None for a random seed")
        for name in ("ignore_eos", "json_extra_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, "a bool", getattr(self, name), "use True or False")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise _invalid("stop_token_ids", "a list of token ids >= 0", ids, "e.g. stop_token_ids=[2]")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.detokenize, bool):
            raise _invalid("detokenize", "a bool", self.detokenize, "use True or False")
        if self.stop and not self.detokenize:
            raise _invalid(
                "detokenize",
                "True when stop strings are given",
                self.detokenize,
                f"stop strings {list(self.stop)!r} are matched on decoded text; drop them or detokenize",
            )
        self._check_constraint()
        self._check_logprobs()
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise _invalid("cache_salt", "a non-empty string", self.cache_salt, "or None to share the cache")

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as it is stored once constructed: sorted ``(id, bias)`` pairs (empty: no bias)."""
        return cast("tuple[tuple[int, float], ...]", self.logit_bias or ())

    def _check_lengths(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1, "ask for at least one new token")
        _check_int("min_new_tokens", self.min_new_tokens, 0, "use 0 to allow stopping at once")
        if self.min_new_tokens > self.max_new_tokens:
            raise _invalid(
                "min_new_tokens",
                f"<= max_new_tokens ({self.max_new_tokens})",
                self.min_new_tokens,
                "lower min_new_tokens or raise max_new_tokens",
            )

    def _check_sampling(self) -> None:
        _check_float(
            "temperature",
            self.temperature,
            0.0,
            math.inf,
            "a finite number >= 0",
            "use 0 for greedy decoding",
        )
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise _invalid(
                "temperature",
                f"0 or at least {MIN_TEMPERATURE:g}",
                self.temperature,
                "use 0 for greedy decoding (a smaller temperature overflows the logits)",
            )
        _check_int("top_k", self.top_k, 0, "use 0 to disable top-k filtering")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _invalid("top_p", "in (0, 1]", self.top_p, "use 1.0 to disable nucleus sampling")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]", "use 0.0 to disable min-p filtering")

    def _check_penalties(self) -> None:
        if not _is_number(self.repetition_penalty) or self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise _invalid(
                "repetition_penalty",
                f"a finite number >= {MIN_REPETITION_PENALTY:g}",
                self.repetition_penalty,
                "use 1.0 for no penalty; values above 1 discourage repeats",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            hint = "use 0.0 for no penalty; positive values discourage repeats"
            _check_float(name, getattr(self, name), -2.0, 2.0, "in [-2, 2]", hint)

    def _check_constraint(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise _invalid(
                " / ".join(CONSTRAINT_FIELDS),
                "given one at a time",
                {name: getattr(self, name) for name in given},
                f"pass only one of {', '.join(given)}",
            )
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _normalize_schema(self.json_schema))
        for name in ("regex", "grammar", "tool_grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _invalid(name, "a non-empty string", value, f"pass the {name} as text, or None")
        if self.reasoning_section is not None and not isinstance(self.reasoning_section, ReasoningSection):
            raise _invalid(
                "reasoning_section", "a ReasoningSection", self.reasoning_section, "use ReasoningSection(...)"
            )

    def _check_logprobs(self) -> None:
        if not isinstance(self.logprobs, bool):
            raise _invalid("logprobs", "a bool", self.logprobs, "use True to report token log-probabilities")
        hint = f"ask for 0 to {MAX_TOP_LOGPROBS} alternatives per token"
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _invalid("top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]", self.top_logprobs, hint)
        if self.top_logprobs and not self.logprobs:
            raise _invalid("logprobs", "True when top_logprobs is given", self.logprobs, "set logprobs=True")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise _invalid(
                "logprobs_mode",
                f"one of {', '.join(LOGPROBS_MODES)}",
                self.logprobs_mode,
                "use 'raw' (the default)",
            )

    @property
    def constraint(self) -> str | None:
        """The name of the constraint field that is set (``"json_schema"``, ``"regex"``, ``"grammar"``,
        ``"tool_grammar"``), or None."""
        return next((name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None), None)

    @property
    def cache_scope(self) -> str:
        """The prefix-cache partition this request reads and writes (``""``: the unsalted one)."""
        return "" if self.cache_salt is None else "salt:" + self.cache_salt

    @property
    def is_greedy(self) -> bool:
        """True when decoding picks the most likely token (``temperature == 0``)."""
        return self.temperature == 0.0


def resolve_params(params: SamplingParams | None, keywords: Mapping[str, Any], where: str) -> SamplingParams:
    """The SamplingParams of a call that takes either ``params`` or SamplingParams fields as keywords
    (``llm.generate("hi", max_new_tokens=5, temperature=0.7)``); defaults when it has neither.

    Raises ``TypeError`` naming the keywords when both are given or a keyword is no SamplingParams field.
    """
    if not keywords:
        return params if params is not None else SamplingParams()
    unknown = sorted(set(keywords) - SAMPLING_FIELDS - {"max_tokens"})
    if unknown:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {', '.join(unknown)}; sampling keywords are the "
            f"SamplingParams fields: {', '.join(sorted(SAMPLING_FIELDS))}"
        )
    if params is not None:
        raise TypeError(
            f"{where}() got both params and the keyword argument(s) {', '.join(sorted(keywords))}; pass one: "
            f"params=SamplingParams(...), or the fields as keywords"
        )
    return SamplingParams(**keywords)


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
