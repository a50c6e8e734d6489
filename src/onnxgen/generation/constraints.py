"""Constrained decoding: JSON schema, regex and Lark grammar via llguidance.

A :class:`Constraint` is one request's grammar state. It is a logits processor (``build_chain`` puts it
after the penalties and the eos mask, before temperature and top-k/p), so greedy and sampled decoding
both choose only tokens the grammar allows, eos included only where the output may end. It *follows*
the sequence it is given: each call brings the grammar to ``seq.generated`` (consuming new tokens,
rolling back ones that changed), so the same object masks every speculative verify position with that
position's prefix, and drafts the grammar rejects are never accepted.

The loop asks :meth:`Constraint.complete` after each emitted token; a complete constraint (nothing but
eos may follow) ends the request with finish reason ``"stop"``, even with ``ignore_eos``. Running out of
``max_new_tokens`` first gives ``"length"`` and a truncated output.

JSON is generated compactly with ``", "`` and ``": "`` separators and no other whitespace (a schema's
``"x-guidance"`` options override this). An object schema that lists its properties allows only those
unless it says otherwise (OpenAI's reading; ``SamplingParams.json_extra_properties`` gives JSON Schema's).

A request whose output starts with a reasoning section (``SamplingParams.reasoning_section``) gets the
constraint as a subgrammar after that section: the thinking is free text (it may not spell the end tag,
so the section ends where a reasoning parser splits it), then the constraint applies to the answer.
Tags that the tokenizer holds as special tokens are named as tokens in the grammar (:meth:`literal`).
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from copy import copy
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxgen.errors import GenerationError
from onnxgen.generation.params import SamplingParams, SamplingParamsError
from onnxgen.generation.processors import Seqs, SequenceView
from onnxgen.generation.reasoning_gate import Literal, after_reasoning, quoted
from onnxgen.generation.schema_objects import close_objects
from onnxgen.tokenizer import Tokenizer

if TYPE_CHECKING:  # llguidance is imported where a request sets a constraint, not by every load
    import llguidance as llg
    from llguidance._lib import JsonCompileOptions  # the type of grammar_from_json_schema's options

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_HINTS = {
    "json_schema": "fix the schema (keywords llguidance does not implement, such as not, if/then/else, "
    "uniqueItems, contains, are errors; 'x-guidance': {'lenient': true} in the schema ignores them)",
    "regex": "fix the regular expression (Rust regex syntax: no lookaround, no backreferences)",
    "grammar": "fix the grammar (Lark syntax with a `start` rule)",
    "tool_grammar": "check the tools' parameter schemas (the grammar is built from them)",
}


class ConstraintError(SamplingParamsError):
    """A json_schema, regex or grammar that does not compile."""


def grammar_source(params: SamplingParams, literal: Literal = quoted) -> tuple[str, str] | None:
    """``(field name, llguidance grammar text)`` for the constraint ``params`` sets, or None.

    ``literal`` gives the grammar syntax of a reasoning tag (a special-token reference or a string)."""
    kind = params.constraint
    if kind not in ("json_schema", "regex", "grammar", "tool_grammar"):
        return None
    import llguidance as llg

    try:
        if kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(_schema_text(params), defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(str(params.regex))
        elif kind == "grammar":
            grammar = llg.LLMatcher.grammar_from_lark(str(params.grammar))
        elif kind == "tool_grammar":
            grammar = llg.LLMatcher.grammar_from_lark(str(params.tool_grammar))
        else:
            return None
    except ValueError as e:  # e.g. a schema nested past llguidance's recursion limit
        raise _compile_error(kind, str(e)) from e
    if params.reasoning_section is not None:
        grammar = after_reasoning(grammar, params.reasoning_section, literal)
    return kind, grammar


def _schema_text(params: SamplingParams) -> str:
    """The request's schema as the constraint reads it: objects closed to their listed properties unless
    ``json_extra_properties`` (:mod:`onnxgen.generation.schema_objects`)."""
    text = str(params.json_schema)
    return text if params.json_extra_properties else json.dumps(close_objects(json.loads(text)))


def _compile_error(kind: str, message: str) -> ConstraintError:
    return ConstraintError(f"{kind} does not compile: {' '.join(message.split())}; {_HINTS[kind]}")


def _first_line(message: str) -> str:
    """llguidance's error without the parser-state dump it appends (``<state>...``)."""
    return " ".join(message.split("<state>")[0].split()) or "no message"


# What llguidance's errors at the first steps of a grammar mean, and how to fix the request
_STEP_HINTS = {
    "NoExtensionBias": "the grammar admits no finite output (a schema whose $ref refers only to itself, "
    "a rule with no base case); give it a way to end",
    "Current row has": "the grammar allows too many alternatives at one point for llguidance's parser "
    "(e.g. hundreds of optional properties of one object); make properties required or split the schema",
}
PROBE_STEPS = 8  # forced-token runs a new grammar is taken through before it is accepted
PROBE_BRANCHES = 2  # at a free choice, the probe follows the grammar's lowest allowed token ids ...
PROBE_DEPTH = 2  # ... through this many free choices
PROBE_MASKS = 24  # masks the probe computes at most


def _step_error(kind: str, message: str) -> ConstraintError:
    line = _first_line(message)
    hint = next((h for key, h in _STEP_HINTS.items() if key in line), _HINTS[kind])
    return ConstraintError(f"{kind} cannot constrain the output: llguidance fails on it ({line}); {hint}")


def _probe(matcher: llg.LLMatcher, kind: str, n_vocab: int) -> None:
    """Take copies of a freshly compiled grammar through its first masks: the forced tokens after each,
    and at a free choice the :data:`PROBE_BRANCHES` lowest allowed token ids (the grammar's punctuation
    in a byte-level vocabulary: a string's closing quote, an object's first key), through
    :data:`PROBE_DEPTH` free choices and at most :data:`PROBE_MASKS` masks.

    llguidance builds its parser lazily: a grammar that compiles can still fail when its masks are
    computed (``{"$ref": "#"}``: no output can end; an object with hundreds of optional properties: the
    parser row of its first key exceeds the item limit, after ``{`` and maybe whitespace). Found here,
    that is a bad request before decoding starts rather than a failure in the middle of it, whichever
    tokens a request then samples. A limit further on than the probe looks is still found mid-decode.
    """
    words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    masks = 0
    stack = [(matcher.deep_copy(), 0)]
    while stack and masks < PROBE_MASKS:
        probe, depth = stack.pop()
        for _ in range(PROBE_STEPS):
            probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            masks += 1
            if probe.is_error():
                raise _step_error(kind, probe.get_error())
            forced = probe.compute_ff_tokens()
            if probe.is_stopped():
                break
            if not forced:
                if depth < PROBE_DEPTH:
                    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
                    for token in reversed(allowed[:PROBE_BRANCHES].tolist()):
                        branch = probe.deep_copy()
                        branch.consume_token(token)
                        if branch.is_error():
                            raise _step_error(kind, branch.get_error())
                        stack.append((branch, depth + 1))
                break
            probe.consume_tokens(forced)
            if probe.is_error():
                raise _step_error(kind, probe.get_error())


def check_constraint(params: SamplingParams) -> None:
    """Compile the constraint without a tokenizer (cheap); raise :class:`ConstraintError` if it is invalid."""
    source = grammar_source(params)
    if source is not None:
        import llguidance as llg

        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(source[1])
        if is_error:
            raise _compile_error(source[0], messages[0])


def constraint_from_response_format(response_format: Mapping[str, Any] | None) -> dict[str, Any]:
    """SamplingParams keyword arguments for an OpenAI ``response_format`` (``{}`` for plain text).

    ``{"type": "json_object"}`` -> any JSON object; ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}}}`` -> that schema (no ``schema`` means any JSON value); ``{"type": "text"}`` -> nothing.
    """
    if response_format is None:
        return {}
    if not isinstance(response_format, Mapping):
        raise SamplingParamsError(
            f"response_format must be an object such as {{'type': 'json_object'}} (got {response_format!r})"
        )
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise SamplingParamsError(
                "response_format.json_schema must be an object such as {'name': 'answer', 'schema': {...}} "
                f"(got {spec!r})"
            )
        return {"json_schema": spec.get("schema", {})}
    raise SamplingParamsError(
        f"response_format.type must be one of 'text', 'json_object', 'json_schema' (got {kind!r}); "
        "use 'json_schema' with a schema to constrain the output"
    )


def _bias_table(dtype: np.dtype) -> np.ndarray:
    """``[256, 8]``: row b holds the additive mask of the 8 tokens whose bits are byte b (little bit order):
    -0.0 for an allowed token (x + -0.0 is x for every x, negative zero included) and -inf otherwise."""
    table = _BIAS_TABLES.get(np.dtype(dtype))
    if table is None:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
        table = np.where(bits, -0.0, -np.inf).astype(dtype)
        _BIAS_TABLES[np.dtype(dtype)] = table
    return table


_BIAS_TABLES: dict[np.dtype, np.ndarray] = {}
_ID = struct.Struct("=q")  # one id as the bytes of a native int64
ROW_CACHE_BYTES = 4 << 20  # additive rows a Constraint keeps by bitmask (256 rows of a 4096-token vocabulary)


class Constraint:
    """One request's grammar state; a logits processor for a single sequence (see the module docstring)."""

    def __init__(
        self,
        matcher: llg.LLMatcher,
        kind: str,
        n_vocab: int,
        eos_ids: Sequence[int] = (),
        forcing: bool = True,
    ) -> None:
        self.kind = kind
        self._matcher = matcher
        self._eos_ids = frozenset(eos_ids)
        self._forcing = forcing  # False: the grammar may turn llguidance's forcing off (greedy_choice)
        self._words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # llguidance's bitmask, 1 bit a token
        self._words_ptr = self._words.ctypes.data
        self._taken = b""  # the int64 ids the grammar state has taken, as bytes (cheap to compare)
        self._version = 0  # bumped whenever the grammar state changes
        self._mask_version = -1
        self._bias = np.zeros(0, dtype=np.float32)  # -0.0 where the grammar allows a token, -inf elsewhere
        # rows built before, by bitmask: a grammar's masks repeat (JSON keys and separators, a lexeme's
        # length), and a hit skips building a row out of the bitmask
        self._rows: dict[bytes, np.ndarray] = {}
        self._rows_key: tuple[int, np.dtype] = (0, np.dtype(np.float32))
        self.seconds = 0.0  # time spent in this constraint: following the sequence, computing/applying masks
        self.masks = 0
        self.shortcuts = 0  # greedy choices made without a mask (see greedy_choice)

    def stats(self) -> dict[str, Any]:
        return {
            "constraint": self.kind,
            "constraint_masks": self.masks,
            "constraint_unmasked": self.shortcuts,
            "constraint_s": self.seconds,
        }

    def __call__(self, seq: Seqs, logits: np.ndarray) -> np.ndarray:
        views = (seq,) if isinstance(seq, SequenceView) else seq
        if len(views) != 1 or logits.size != logits.shape[-1]:
            raise ValueError(
                f"a Constraint masks one sequence, got {len(views)} views for logits of shape {logits.shape}; "
                "give each row of a batch its own Constraint"
            )
        start = time.perf_counter()
        if not self._follow(views[0].generated):
            return logits  # the prefix left the language: no position after it is ever used
        # -inf where the grammar refuses the token (a +inf logit there would become NaN: no model emits one)
        out = np.add(logits, self._bias_now(logits.shape[-1], logits.dtype).reshape(logits.shape))
        self.seconds += time.perf_counter() - start
        self.masks += 1
        return out

    def greedy_choice(self, generated: np.ndarray, argmax: int) -> int | None:
        """The greedy token after ``generated`` when it can be told without the mask, else None.

        ``argmax`` is the argmax of the logits before the mask. The masked argmax is the first allowed token
        in descending logit order, which llguidance's mask computation gives without the mask:

        - where forced bytes make whole tokens (``compute_ff_tokens``) the mask is the first of them alone:
          that token is the choice, whatever ``argmax`` is;
        - elsewhere the mask holds every token the grammar takes (and more where bytes are forced: pieces
          of them), so a non-eos ``argmax`` the grammar takes is the choice.

        A grammar that turns forcing off (``no_forcing``) gets the second rule only. The token returned has
        been taken by the grammar state (the caller chooses it). Tests check both rules against the mask.
        """
        start = time.perf_counter()
        choice = None
        if self._follow(generated):
            fast_forward = self._matcher.compute_ff_tokens() if self._forcing else None
            choice = fast_forward[0] if fast_forward else argmax if argmax not in self._eos_ids else None
            if choice is not None and self._matcher.try_consume_tokens([choice]) == 1:
                self._taken += _ID.pack(choice)
                self._version += 1
                self.shortcuts += 1
            else:
                choice = None
        self.seconds += time.perf_counter() - start
        return choice

    def complete(self, generated: np.ndarray) -> bool:
        """Follow ``generated`` (the ids generated so far); True when nothing but eos may follow."""
        start = time.perf_counter()
        followed = self._follow(generated)
        self.seconds += time.perf_counter() - start
        if not followed:
            if self._matcher.is_error():  # a parser limit hit in the middle of the output
                raise _step_error(self.kind, self._matcher.get_error())
            done = len(self._taken) // 8
            raise GenerationError(
                f"token {int(generated[done])} (position {done}) is outside the {self.kind} "
                "constraint; tokens of a constrained request must be chosen through its processor chain"
            )
        return self._matcher.is_stopped()

    def _follow(self, generated: np.ndarray) -> bool:
        """Bring the grammar state to ``generated``; False when some token of it is not allowed."""
        ids = generated.tobytes() if generated.dtype == np.int64 else generated.astype(np.int64).tobytes()
        taken = self._taken
        if ids == taken:
            return True
        if ids.startswith(taken):
            common = len(taken) // 8
        else:  # some ids changed (a speculative verify row, a rejected draft): roll back to the common prefix
            done = len(taken) // 8
            shared = min(done, len(ids) // 8)
            differ = np.flatnonzero(
                np.frombuffer(taken, np.int64, shared) != np.frombuffer(ids, np.int64, shared)
            )
            common = int(differ[0]) if len(differ) else shared
            if not self._matcher.rollback(done - common):
                raise GenerationError(f"the {self.kind} constraint could not roll back: {self._error()}")
            self._version += 1
            if len(ids) == 8 * common:
                self._taken = ids
                return True
        took = self._matcher.try_consume_tokens(np.frombuffer(ids, np.int64)[common:].tolist())
        self._taken = ids[: 8 * (common + took)]
        self._version += 1
        return 8 * (common + took) == len(ids)

    def _bias_now(self, width: int, dtype: np.dtype) -> np.ndarray:
        """The mask as an additive row over token ids below ``width``: -0.0 where the grammar allows the token
        next, ``-inf`` elsewhere; cached until the grammar state changes. Adding it costs one numpy call
        (a masked copy costs two, and unpacking the bits another two). Rows are kept by bitmask (up to
        :data:`ROW_CACHE_BYTES` of them): most masks of a request have been seen before."""
        if self._mask_version == self._version and len(self._bias) == width and self._bias.dtype == dtype:
            return self._bias
        self._matcher.unsafe_compute_mask_ptr(self._words_ptr, self._words.nbytes)
        if self._matcher.is_error():
            raise _step_error(self.kind, self._matcher.get_error())
        if self._rows_key != (width, dtype):  # a new logits width or dtype: rows built before do not fit
            self._rows = {}
            self._rows_key = (width, dtype)
        key = self._words.tobytes()
        bias = self._rows.get(key)
        if bias is None:
            bias = self._build_row(width, dtype)
            if (len(self._rows) + 1) * bias.nbytes > ROW_CACHE_BYTES:
                self._rows.clear()
            self._rows[key] = bias
        self._bias = bias
        self._mask_version = self._version
        return bias

    def _build_row(self, width: int, dtype: np.dtype) -> np.ndarray:
        """The additive row of the bitmask in ``_words``; ids past the token table are never allowed."""
        n_bits = 8 * self._words.nbytes
        rows = np.full(max(width, n_bits), -np.inf, dtype=dtype)
        np.take(
            _bias_table(dtype),
            self._words.view(np.uint8),
            axis=0,
            out=rows[:n_bits].reshape(-1, 8),
            mode="wrap",  # byte values always index the table: no bounds-check buffer
        )
        return rows[:width]

    def _error(self) -> str:
        return _first_line(self._matcher.get_error())


class ConstraintCompiler:
    """Compiles a request's constraint against one model's tokenizer.

    The token table is built once. Compiled grammars are kept (the last ``cache_size``) and each request
    gets a copy, so a repeated schema skips compiling and reuses the lexer states earlier requests built.
    """

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: Sequence[int], cache_size: int = 32
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = [int(i) for i in eos_ids]
        self.cache_size = cache_size
        self._ll_tokenizer: llg.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: SamplingParams) -> Constraint | None:
        """The request's :class:`Constraint` (None when it sets none); raises :class:`ConstraintError`
        before any decoding when the schema/regex/grammar is invalid or fails its first steps, and
        :class:`GenerationError` when the model has no tokenizer."""
        source = grammar_source(params, self.literal)
        if source is None:
            return None
        kind, grammar = source
        ll_tokenizer = self._token_table(kind)
        with self._lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return self._constraint(template, kind, grammar)
        import llguidance as llg

        template = llg.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _compile_error(kind, template.get_error())
        _probe(template, kind, ll_tokenizer.vocab_size)
        with self._lock:
            self._compiled[source] = template
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
            return self._constraint(template, kind, grammar)

    def literal(self, text: str) -> str:
        """Lark syntax of the fixed text ``text`` in a grammar for this model: ``<[id]>`` when the tokenizer
        holds it as one token that llguidance treats as special (such tokens cannot be spelled in a
        grammar: Qwen's ``<tool_call>``, ``<think>``), else a string literal."""
        token = self.tokenizer.token_to_id(text) if self.tokenizer is not None else None
        if token is not None and self._token_table("grammar").is_special_token(token):
            return f"<[{token}]>"
        return quoted(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a piece of a UTF-8 character for some tokens)."""
        return bytes(self._token_table("logprobs").decode_bytes([int(token_id)]))

    def _constraint(self, template: llg.LLMatcher, kind: str, grammar: str) -> Constraint:
        assert self._ll_tokenizer is not None
        return Constraint(
            template.deep_copy(),
            kind,
            self._ll_tokenizer.vocab_size,
            self.eos_ids,
            forcing="no_forcing" not in grammar,  # a Lark grammar's %llguidance options may turn it off
        )

    def _token_table(self, kind: str) -> llg.LLTokenizer:
        if self.tokenizer is None:
            raise GenerationError(
                f"{kind} constrains text, but this model has no tokenizer to map it to token ids; "
                "put its tokenizer.json beside model.onnx"
            )
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance as llg

                backend = copy(self.tokenizer.backend)
                backend.no_padding()
                backend.no_truncation()
                n_vocab = max(self.vocab_size, self.tokenizer.vocab_size)
                self._ll_tokenizer = llg.LLTokenizer(
                    backend.to_str(), n_vocab=n_vocab, eos_token=self.eos_ids or None
                )
            return self._ll_tokenizer
