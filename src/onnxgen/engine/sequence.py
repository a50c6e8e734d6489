"""Sequence: one prompt's decoding, whoever drives it (the single-sequence loop, the batch scheduler, the server).

A sequence owns its whole selection and stopping chain: the processors built from its own
:class:`~onnxgen.generation.params.SamplingParams` (with its own constraint state), its own seeded sampler,
the token stop checks, and (:class:`TextStream`) its incremental detokenizer and stop-string matcher. Rows
of a batch share nothing but the forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Ids
from typing import Any

import numpy as np

from onnxgen.generation.constraints import Constraint
from onnxgen.generation.logprobs import TokenLogprob, choose_scored
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.processors import SequenceView, TokenChoice, apply_chain, build_chain
from onnxgen.generation.sampling import Sampler, check_chosen
from onnxgen.generation.speculative import Speculative
from onnxgen.generation.stopping import StopChecker, StopStringMatcher, StopStrings
from onnxgen.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """The text of a sequence's tokens as they come: decoded incrementally, cut at the first stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt: Ids[int],
        stop: StopStrings | tuple[str, ...] | list[str] | str | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt)
        self.stops = StopStringMatcher(stop) if stop else None

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer | None,
        prompt: Ids[int],
        params: SamplingParams,
        stops: StopStrings | None = None,
    ) -> TextStream | None:
        """The stream ``params`` asks for (None without a tokenizer or where ``detokenize`` is off);
        ``stops``: ``params.stop`` compiled once for several sequences (else compiled here)."""
        if tokenizer is None or not params.detokenize:
            return None
        return cls(tokenizer, prompt, (stops or params.stop) if params.stop else None)

    def feed(self, token: int, reason: str | None) -> tuple[str, str | None]:
        """The text ``token`` completes and the finish reason: ``reason``, or ``"stop"`` at a stop string
        (the text then ends before it); at the end, whatever was held back is flushed."""
        piece = self.detok.feed(token)
        if reason is not None:
            piece += self.detok.flush()
        if self.stops is None:
            return piece, reason
        match = self.stops.feed(piece)
        if match.stopped:
            return match.text, "stop"
        if reason is not None:
            return match.text + self.stops.flush(), reason
        return match.text, reason


class Sequence:
    """One sequence's ids (prompt, then generated), its token selection and its stop checks.

    ``slot`` is the batch row a scheduler gave it (None while it waits or prefills), ``offset`` the prompt
    tokens prefilled so far (resumed from the prefix cache: ``cached_tokens`` of them); ``scores`` the
    log-probability of each emitted token when the request asks. ``speculative``: what it drafts with (a
    scheduler then decodes it alone, through the library's speculative loop); ``extra_stats``: statistics
    of that loop, merged into its final ones.
    """

    def __init__(
        self,
        prompt: Ids[int] | np.ndarray,
        params: SamplingParams,
        eos_ids: Ids[int],
        constraint: Constraint | None = None,
        text: TextStream | None = None,
        speculative: Speculative | None = None,
    ) -> None:
        self.params = params
        self.speculative = speculative
        self.prompt_len = len(prompt)
        self.ids = np.zeros(len(prompt) + params.max_new_tokens, dtype=np.int64)
        self.ids[: len(prompt)] = prompt
        self.n = len(prompt)
        self.constraint = constraint  # a grammar state of this sequence alone
        self.chain = build_chain(params, eos_ids, constraint)
        self.sampler = None if params.is_greedy else Sampler(params.seed)
        self.choose = TokenChoice(self.chain, self.sampler)
        self.checker = StopChecker(params, eos_ids)
        self.scores: list[TokenLogprob] | None = [] if params.logprobs else None
        self.text = text
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended with finish reason "error"
        self.client_error = False  # whether the request itself caused it (its grammar hit a parser limit)
        self.slot: int | None = None
        self.offset = 0
        self.cached_tokens = 0  # prompt tokens resumed from the prefix cache (not prefilled)
        self.arrived = time.perf_counter()
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.extra_stats: dict[str, Any] = {}

    @property
    def may_yield(self) -> bool:
        """Whether this speculative sequence may decode in a batch row while plain rows decode (and in its
        lane otherwise): a greedy one (its tokens are plain greedy decoding's whichever forward path
        computes them) or a sampled one without a seed (no tokens were promised, and a batch row samples
        the same processed distribution as the speculative acceptance rule does). A seeded sampled one
        keeps its lane, so that its tokens are the library's for that seed."""
        return self.speculative is not None and (self.sampler is None or self.params.seed is None)

    @property
    def prompt(self) -> np.ndarray:
        return self.ids[: self.prompt_len]

    @property
    def generated(self) -> int:
        return self.n - self.prompt_len

    @property
    def last_token(self) -> int:
        return int(self.ids[self.n - 1])

    def check(self, token: int) -> str | None:
        """The finish reason after ``token`` (already in ``ids``): the constraint complete, eos, or length."""
        if self.constraint is not None and self.constraint.complete(self.ids[self.prompt_len : self.n]):
            return "stop"  # the output is complete under the grammar: nothing but eos may follow
        return self.checker.check(token, self.n - self.prompt_len)

    def process(self, row: np.ndarray, prefix_len: int) -> np.ndarray:
        """``row`` through the processor chain, as the token after ``ids[:prefix_len]`` sees it."""
        if not self.chain:
            return row
        return apply_chain(self.chain, SequenceView(self.ids[:prefix_len], self.prompt_len), row)

    def select(self, logits: np.ndarray, export: str = "the model") -> int:
        """The next token from this sequence's logits row (processors are out-of-place), its
        log-probability recorded when the request asks for it. A row whose chosen logit (or, when
        scoring, whose maximum) is not finite raises :class:`GenerationError` naming ``export``."""
        if self.scores is None:
            token = self.choose(self.ids[: self.n], self.prompt_len, logits)
            check_chosen(logits, token, export, self.generated)
            return token
        top = int(np.argmax(logits))  # (NaN wins an argmax: the row's scores would be NaN)
        check_chosen(logits, top, export, self.generated)
        token, score = choose_scored(self.choose, self.params, self.ids[: self.n], self.prompt_len, logits)
        self.scores.append(score)
        return token

    def append(self, token: int) -> str | None:
        """Put ``token`` after the ids; the finish reason it brings (None to go on)."""
        self.ids[self.n] = token
        self.n += 1
        return self.check(token)

    def add(self, token: int) -> tuple[str, str | None]:
        """:meth:`append` ``token`` and stream it: the text it completes and the finish reason (also kept
        in ``finish_reason``), a stop string counted."""
        return self._stream(token, self.append(token))

    def put(self, token: int, reason: str | None) -> tuple[str, str | None]:
        """As :meth:`add`, for a token another loop chose and checked (its finish reason ``reason``)."""
        self.ids[self.n] = token
        self.n += 1
        return self._stream(token, reason)

    def _stream(self, token: int, reason: str | None) -> tuple[str, str | None]:
        self.last_token_at = time.perf_counter()
        if self.generated == 1:
            self.first_token_at = self.last_token_at
        piece = ""
        if self.text is not None:
            piece, reason = self.text.feed(token, reason)
        self.finish_reason = reason
        return piece, reason

    @property
    def last_score(self) -> TokenLogprob | None:
        return self.scores[-1] if self.scores else None
