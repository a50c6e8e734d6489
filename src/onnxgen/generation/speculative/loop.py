"""The speculative token loop: propose k drafts, verify them in one target forward, commit.

Commit after accepting j of k drafts (docs/speculative-commit.md): the verify forward ran the pending
token and all k drafts, so the model must be brought back to "pending + j drafts" fed.
- Full accept (j = k): nothing to do, the state is exact.
- KV-only models: rewind the KV cursor (shared buffers) or slice the caches (growing).
- Models with recurrent state: when the session has a verify plan (:mod:`onnxgen.runtime.state_commit`),
  the verify forward also fetches per-position states (b) or the state ops' inputs (c), and the plan
  commits the states after the j + 1 kept tokens without a replay. Otherwise (or when the plan cannot),
  restore the snapshot taken before the verify (free: the states are double-buffered, so a snapshot is
  a set of pinned references) and re-run only the j + 1 kept tokens (strategy (a): universal, costs a
  short replay).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from onnxruntime import OrtValue

from onnxgen.errors import GenerationError
from onnxgen.generation.constraints import Constraint
from onnxgen.generation.logprobs import TokenLogprob, token_logprob
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.sampling import check_chosen
from onnxgen.generation.speculative.accept import accept_greedy_lazily, accept_sampled
from onnxgen.generation.speculative.budget import DraftBudget
from onnxgen.generation.token_loop import TokenLoop
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

# Adaptive draft length: at most this many times the starting k (the cost model in DraftBudget caps each
# verify below that); doubled after a full accept, one less after a rejection.
MAX_DRAFT_FACTOR = 3
# Auto: decide after this many verifies; stop speculating when the predicted speedup is below this.
AUTO_MIN_VERIFIES = 4
AUTO_MIN_GAIN = 1.0


def next_draft_length(k: int, full_accept: bool, max_k: int) -> int:
    """The draft length after a verify that carried up to ``k`` drafts: doubled (at least +2) after a
    full accept, so that a long accepted run (a quoted span, a loop) reaches ``max_k`` in a few verifies
    instead of growing by 2 per verify (fewer target forwards: docs/benchmarks.md); one less after a
    rejection."""
    if full_accept:
        return min(max(2 * k, k + 2), max_k)
    return max(1, k - 1)


class Proposer(Protocol):
    """See :mod:`.proposers`. ``target_outputs`` and ``observe_target`` may be left out (none read);
    ``chained`` (true for a drafter whose later drafts are made from its own earlier guesses, so are
    accepted less often) may be left out too (false)."""

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], list[np.ndarray] | None]: ...
    def observe(self, context_len: int, accepted: int) -> None: ...
    def reset(self, prompt_len: int) -> None: ...


class SpeculativeLoop(TokenLoop):
    """A :class:`TokenLoop` that emits several tokens per target forward when drafts are accepted.

    A constrained request keeps speculating: its :class:`Constraint`, in the chain, masks each verify
    position with that position's prefix, so drafts the constraint rejects are never accepted.

    A proposer that reads target outputs (``target_outputs``: an MTP head reads the final hidden state)
    gets them from every target forward: the prefill, plain steps and verifies fetch them, and the rows of
    the committed positions are handed over (``observe_target``) before the commit.

    ``auto``: speculation stops for the rest of the request once the cost model (:mod:`.budget`, fed with
    this request's timings) predicts it slower than plain decoding, after ``AUTO_MIN_VERIFIES`` verifies;
    the rest of the request is :class:`TokenLoop`'s plain decoding (no drafts, no target outputs fetched).
    """

    def __init__(
        self,
        session: DecoderSession,
        state: DecodeState,
        prompt: Sequence[int] | np.ndarray,
        params: SamplingParams,
        eos_ids: Sequence[int],
        proposer: Proposer,
        num_draft_tokens: int,
        adaptive: bool = True,
        constraint: Constraint | None = None,
        export: str = "the model",
        auto: bool = False,
    ) -> None:
        super().__init__(session, state, prompt, params, eos_ids, constraint, export)
        self.proposer = proposer
        proposer.reset(self.prompt_len)  # penalties and min_new_tokens need the prompt/generated split
        self.wanted: tuple[str, ...] = tuple(getattr(proposer, "target_outputs", ()))
        self._verify_fetch: tuple[str, ...] | None = None  # the plan's outputs and ``wanted`` (one object)
        self.auto = auto
        self.speculating = True
        self.gain: float | None = None  # the cost model's last predicted speedup (auto)
        self.off_after: int | None = None  # verifies run when auto turned speculation off
        self.k = num_draft_tokens
        self.max_k = MAX_DRAFT_FACTOR * num_draft_tokens if adaptive else num_draft_tokens
        self.adaptive = adaptive
        self.proposed = 0
        self.accepted = 0
        self.replays = 0
        self.hybrid = bool(session.io.state_pairs)
        # a chained drafter's acceptance falls with the draft's depth: the budget keeps a rate per depth
        chained = bool(getattr(proposer, "chained", False))
        self.budget = DraftBudget(per_depth=chained) if adaptive or auto else None
        self.verifies = 0
        # Back-off: after verifies that accepted nothing, run 1, 2, 4, ... (at most 16) plain steps
        # before drafting again, so a prompt whose drafts keep failing decodes at nearly plain speed.
        self._misses = 0
        self._skip = 0

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "proposed_draft_tokens": self.proposed,
            "accepted_draft_tokens": self.accepted,
            "target_forward_passes": self.forward_passes,
            "state_replays": self.replays,
        }
        if self.auto:
            out["speculation"] = "on" if self.speculating else f"off after {self.off_after} verifies"
            out["predicted_speedup"] = self.gain
        return out

    def _forward_fetching(self, tokens: int, num_logits: int) -> np.ndarray:
        """A target forward over the next ``tokens`` ids that hands the proposer's outputs over; the logits
        of its last ``num_logits`` rows (a view, consumed at once)."""
        start = self.state.length
        fetched: dict[str, OrtValue] = {}
        ids = self.ids[None, start : start + tokens]
        logits = self.session.forward(
            self.state, ids, num_logits, fetch=self.wanted, fetched=fetched, copy=False
        )
        self.proposer.observe_target(start, fetched, tokens)  # type: ignore[attr-defined]
        return logits[0]

    def _prefill(self) -> np.ndarray:
        if not self.wanted:
            return super()._prefill()
        start = time.perf_counter()
        logits = self._forward_fetching(self.n, 1)[-1]
        self.prefill_s = time.perf_counter() - start
        self.forward_passes += 1
        return logits

    def _plain_step(self) -> np.ndarray:
        """A plain step; one that hands the proposer's outputs over runs on a lane too (the session's
        fetching lane), so that it costs, and ``auto`` times, what plain decoding's steps do."""
        token = int(self.ids[self.n - 1])
        if not self.wanted:
            return self.session.step(self.state, token)
        start = self.state.length
        fetched: dict[str, OrtValue] = {}
        logits = self.session.step(self.state, token, fetch=self.wanted, fetched=fetched)
        self.proposer.observe_target(start, fetched, 1)  # type: ignore[attr-defined]
        return logits

    def _decide(self) -> None:
        """Auto: stop speculating when the measured costs and acceptance predict no gain."""
        if not self.auto or self.budget is None or self.verifies < AUTO_MIN_VERIFIES:
            return
        # plain decoding's steps run on the session's lanes: their time, not that of the steps timed here
        # (which also hand the proposer its outputs, and mostly miss the lanes between verifies)
        self.gain = self.budget.gain(self.max_k, self.session.lane_step_s if self.wanted else None)
        if self.gain is not None and self.gain < AUTO_MIN_GAIN:
            self.speculating = False
            self.off_after = self.verifies

    def _emit(self, token: int) -> str | None:
        self.ids[self.n] = token
        self.n += 1
        return self.check(token)

    def tokens(self) -> Iterator[tuple[int, str | None]]:
        token = self.select(self._prefill())
        reason = self._emit(token)
        yield token, reason
        if reason is None:
            yield from self.drafting()

    def drafting(self) -> Iterator[tuple[int, str | None]]:
        """:meth:`tokens` after the first: drafts and verifies from the pending token ``ids[n - 1]``, the
        state holding ``ids[:n - 1]`` (also where :meth:`adopt` leaves a loop)."""
        if not self.speculating:
            yield from self._plain_rest()
            return
        reason = None
        while reason is None:
            room = self.params.max_new_tokens - (self.n - self.prompt_len)
            k = min(self.k, room - 1)
            if self._skip > 0:
                self._skip -= 1
                k = 0
            if self.auto and self.verifies and self.budget is not None and self.budget.cost(1) is None:
                k = 0  # auto needs a plain step's time to compare verifies with
            if self.adaptive and self.budget is not None and k > 0:
                k = self.budget.cap(k)
            width = self.session.serial_width
            if width is not None:  # verifies of exactly ``width`` tokens are the exact ones: draft that many
                k = width - 1 if k > 0 and width - 1 <= room - 1 else 0
            started = time.perf_counter()
            drafts, q = self.proposer.propose(self.ids[: self.n], k) if k > 0 else ([], None)
            if drafts and width is not None:
                drafts, q = _pad_drafts(drafts, q, width - 1)
            if self.budget is not None and self.verifies:
                # (not before the first verify: a draft model or MTP head also runs the prompt then)
                self.budget.observe_proposal(len(drafts), time.perf_counter() - started)
            if not drafts:  # nothing to verify: a plain step
                started = time.perf_counter()
                logits = self._plain_step()
                if self.budget is not None:
                    self.budget.observe_forward(1, time.perf_counter() - started)
                self.forward_passes += 1
                emitted = [self.select(logits, self.export)]
            else:
                started = time.perf_counter()
                emitted = self._verify(drafts, q)
                if self.budget is not None:  # the forward and the commit (a replay, if any)
                    self.budget.observe_forward(len(drafts) + 1, time.perf_counter() - started)
            for i, token in enumerate(emitted):
                reason = self._emit(token)
                self.ready = len(emitted) - 1 - i
                yield token, reason
                if reason is not None:
                    return
            if not self.speculating:  # auto turned drafting off: the rest is plain decoding
                yield from self._plain_rest()
                return

    def _plain_rest(self) -> Iterator[tuple[int, str | None]]:
        logits = self.session.step(self.state, int(self.ids[self.n - 1]))
        self.forward_passes += 1
        yield from self._decode(logits)

    def adopt(
        self, ids: np.ndarray, scores: list[TokenLogprob] | None, load: Callable[[DecodeState], None]
    ) -> None:
        """Take the sequence over where another forward path (a batch row) left it: ``ids`` (the last one
        pending), its ``scores`` so far, and ``load``, which writes that path's state of ``ids[:-1]`` into this
        loop's (emptied) state, exactly. A proposer that reads target outputs is first handed those of the
        positions this loop did not run, from a forward of them on its own state (which ``load`` then
        replaces: that forward's rounding reaches the drafts only, never the tokens). :meth:`drafting`
        goes on from there."""
        n = len(ids)
        if not self.state.length < n <= len(self.ids):
            raise GenerationError(
                f"a loop at {self.state.length} tokens cannot adopt a sequence of {n} ids (capacity {len(self.ids)})"
            )
        self.ids[:n] = ids
        self.n = n
        self.ready = 0
        if scores is not None:
            self.scores = list(scores)
        if self.wanted and self.speculating and self.state.length < n - 1:
            self._forward_fetching(n - 1 - self.state.length, 1)
            self.forward_passes += 1
        load(self.state)

    def _verify(self, drafts: list[int], q: list[np.ndarray] | None) -> list[int]:
        k = len(drafts)
        n = self.n  # ids[n-1] is the pending token, not yet run by the target
        start = self.state.length
        snap = self.state.snapshot() if self.hybrid else None
        self.ids[n : n + k] = drafts
        plan = self.session.verify_plan if snap is not None else None
        fetched: dict[str, OrtValue] = {}
        fetch = plan.outputs if plan is not None else ()
        if self.wanted:
            want = (*fetch, *self.wanted)
            if self._verify_fetch != want:
                self._verify_fetch = want
            fetch = self._verify_fetch
        ids = self.ids[None, n - 1 : n + k]
        # a view of the verify binder's logits buffer: consumed here, before any other forward of this size
        logits = self.session.forward(self.state, ids, k + 1, fetch=fetch, fetched=fetched, copy=False)[0]
        self.forward_passes += 1
        if self.sampler is None:  # each position's token as plain greedy picks it, up to the first miss
            j, token = accept_greedy_lazily(
                lambda i: self.choose(self.ids[: n + i], self.prompt_len, logits[i]), drafts
            )
        else:
            rows = [self.process(logits[i], n + i) for i in range(k + 1)]
            j, token = accept_sampled(rows, drafts, q, self.sampler)
        for i, chosen in enumerate([*drafts[:j], token]):  # each from its row: a NaN row wins an argmax
            check_chosen(logits[i], chosen, self.export, self.generated + i)
        if self.scores is not None:  # before any other forward: ``logits`` is a view of the verify buffer
            self._score_verified([*drafts[:j], token], logits, n)
        if self.wanted:  # before the commit, whose replay may reuse the fetched buffers
            self.proposer.observe_target(start, fetched, j + 1)  # type: ignore[attr-defined]
        if j < k:
            if snap is None:
                self.state.rewind(start + j + 1)
            elif plan is None or not plan.commit(self.state, snap, fetched, k + 1, j + 1):
                self.state.restore(snap)
                self.session.forward(self.state, self.ids[None, n - 1 : n + j], 1)
                self.forward_passes += 1
                self.replays += 1
        if snap is not None:
            self.state.release(snap)
        self.proposed += k
        self.accepted += j
        self.verifies += 1
        if self.budget is not None:
            self.budget.observe_verify(k, j)
            self._decide()
        self.proposer.observe(n, j)
        if self.adaptive:
            self.k = next_draft_length(self.k, j == k, self.max_k)
        if j == 0:
            self._skip = min(2**self._misses, 16)
            self._misses += 1
        else:
            self._misses = 0
        return [*drafts[:j], token]

    def _score_verified(self, emitted: list[int], logits: np.ndarray, n: int) -> None:
        """Record the log-probability of each token a verify emitted (row i scores the i-th)."""
        assert self.scores is not None
        for i, token in enumerate(emitted):
            row = logits[i] if self.params.logprobs_mode == "raw" else self.process(logits[i], n + i)
            self.scores.append(token_logprob(row, token, self.params.top_logprobs))


def _pad_drafts(
    drafts: list[int], q: list[np.ndarray] | None, k: int
) -> tuple[list[int], list[np.ndarray] | None]:
    """``drafts`` made ``k`` long by repeating the last one (a guess like any other: the verify accepts it
    only where the target agrees), each added draft proposed with certainty (a one-hot ``q``)."""
    extra = k - len(drafts)
    if extra <= 0:
        return drafts[:k], None if q is None else q[:k]
    if q is not None:
        onehot = np.zeros_like(q[-1])
        onehot[drafts[-1]] = 1
        q = [*q, *([onehot] * extra)]
    return [*drafts, *([drafts[-1]] * extra)], q
