"""Scheduler: admits sequences, prefills them in chunks, decodes the running ones together, retires them.

Each :meth:`Scheduler.step`

1. prefills waiting prompts (in chunks of at most ``prefill_chunk`` tokens per step, so a long prompt
   never stalls the running rows for long), each admitted only when a batch row is free for it; a
   finished prompt's first token is chosen from its last logits and it takes a row. Prompts are
   prefilled one at a time (batch 1), but those of equal length among the prompts the step takes anyway
   run as one multi-row forward (*batched prefill*, below);
2. decodes every running row in one forward (:class:`~onnxgen.runtime.batch.BatchState`), each row choosing
   its token with its own processors and sampler;
3. retires the rows that finished (their slot is reused at once).

A speculative sequence (``Sequence.speculative``) runs in a lane of its own instead (:mod:`.lane`: one
verify or plain step per iteration, on its own state, through the library's speculative loop), beside the
batch; it counts against ``max_batch`` as a row does. A lane's forward is one more the iteration waits
for, so a speculative sequence *yields while plain rows decode* (greedy ones and unseeded sampled ones:
``Sequence.may_yield``): with plain company (a plain row
running, or a plain prompt prefilling) it decodes as an ordinary batch row (its state copied into one),
and goes back to its lane, state copied back, once it has been without plain company for
``RESUME_AFTER`` iterations in a row (one that arrives with plain company is prefilled as a row, and gets
its lane then). A greedy one's tokens stay plain greedy decoding's whichever path computes them; an
unseeded sampled one's are drawn from the same distribution either way. A seeded sampled one keeps its
lane throughout: its tokens come from the speculative acceptance rule and its seeded draws, which a batch
row would change with the company it had. Speculative sequences are no company to each other (each
asked to speculate); ``yields`` and ``resumes`` count the moves.

With the model's prefix cache (:mod:`onnxgen.cache.prefix`), a prompt's prefill starts from its longest
cached prefix, stops at the cache's checkpoints (caching each), and a finished row's sequence is cached
from the batch row before it is retired. The cache never fails a request: where it does, the prompt is
prefilled whole (or the sequence is not cached) and the error is logged.

A sequence's rows never depend on their company: the batch pads every step to ``min_rows`` where the
export's kernels compute one row differently from several.

Batched prefill (``BatchLimits.batch_prefill``): of the waiting prompts one step prefills anyway (those
ahead in the queue whose tokens fit the step's budget, and rows are free for), those of one length
(at least 2 tokens, at most one chunk: a prompt the step prefills in one forward) run as one forward of
one row each, from fresh states; every row is computed as the prompt alone would be (the same
position ids, mask and kernels; attention, recurrent and conv states are per row), so its logits and
states are the same bits (``tests/engine/test_batch_prefill.py``). Cuts never move for company: a
prompt in a batch is cut where it would be alone. Where ``min_rows`` is 2 (kernels that compute a lone
row differently), every prefill forward keeps the last two positions' logits, so the logits projection
runs a block of rows alone as in a batch. Prompts run one at a time where the prefix cache is on (their
resume points and checkpoints are their own), for prompts longer than a chunk or of one token, and for
speculative sequences; a batched forward that fails is retried one prompt at a time, so a bad prompt
fails alone.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from onnxgen.cache.prefix import PrefixCache
from onnxgen.engine.lane import Lane, LaneFactory
from onnxgen.engine.limits import BatchLimits
from onnxgen.engine.sequence import Sequence
from onnxgen.errors import GenerationError, OnnxgenError
from onnxgen.generation.constraints import ConstraintError
from onnxgen.generation.logprobs import TokenLogprob
from onnxgen.generation.sampling import check_model_logits
from onnxgen.runtime.batch import BatchState
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Emitted:
    """What one sequence got from one forward: ``token`` (-1 where it failed, ``seq.error`` saying why),
    the text it completes, the finish reason it brought and its log-probability (when asked for)."""

    seq: Sequence
    token: int
    text: str
    finish_reason: str | None
    logprob: TokenLogprob | None


class QueueFull(GenerationError):
    """More sequences wait than ``max_queue`` allows; retry later."""


RESUME_AFTER = 4  # iterations without plain company before a yielded sequence takes its lane again


def prefill_cut(left: int, chunk: int) -> int:
    """The next prefill forward's tokens of a prompt with ``left`` tokens to go, in chunks of ``chunk``: cut
    at fixed offsets (multiples of ``chunk``) whatever else a step prefills, and never a lone last token
    (a one-token forward takes the single-token path, which rounds differently): where one would be left,
    the last cut moves back by one, or with chunks of 2 the last chunk takes 3."""
    if left <= chunk:
        return left
    if left == chunk + 1:
        return chunk - 1 if chunk > 2 else left
    return chunk


class Scheduler:
    """Waiting, prefilling and running sequences over one :class:`BatchState`."""

    def __init__(
        self,
        session: DecoderSession,
        limits: BatchLimits,
        export: str = "the model",
        prefix_cache: PrefixCache | None = None,
        lanes: LaneFactory | None = None,
    ) -> None:
        """``lanes`` opens the lanes of speculative sequences (None: such sequences are refused)."""
        self.session = session
        self.lane_factory = lanes
        self.lanes: list[Lane] = []
        self.parked: dict[Sequence, Lane] = {}  # the lanes of speculative sequences decoding in batch rows
        self.yields = 0  # speculative sequences moved into (or started in) batch rows for plain company
        self.resumes = 0  # speculative batch rows moved into their lanes (the company left)
        self._quiet = 0  # iterations in a row without plain company
        self.rows_only: set[Sequence] = set()  # speculative sequences whose move into a lane failed
        self.limits = limits
        self.export = export  # named by the error when a prompt's logits are not finite
        self.prefix_cache = prefix_cache
        self._cuts: list[int] = []  # the prefix cache's checkpoints still ahead of the prefill
        self.batch = BatchState(session, limits.max_batch, limits.max_model_len, limits.min_rows)
        self._prefill_state = session.new_state(limits.max_model_len)
        self._cohort_states: dict[int, DecodeState] = {}  # batched prefill's states, by rows
        self._alone = 0  # prompts to prefill one at a time before batching again (after a failed batch)
        # logits kept per prefill forward: 2 where the logits projection computes a lone row apart
        self._keep = 2 if limits.min_rows >= 2 else 1
        self.running: list[Sequence] = []  # ``running[i]`` holds batch row i
        self.waiting: deque[list[Sequence]] = deque()  # groups: the choices of one prompt
        self.prefilling: list[Sequence] | None = None
        self.prefilled_tokens = 0  # prompt tokens prefilled so far
        self.last_decode: tuple[int, float] = (0, 0.0)  # rows and seconds of the last decode forward
        self.copy_seconds = 0.0  # spent copying states into and out of batch rows (admit, retire)

    def add(self, group: list[Sequence]) -> None:
        """Queue ``group``, sequences of one prompt (the choices of a request: prefilled once, then a row
        each), or raise :class:`QueueFull`."""
        if len(group) > self.limits.max_batch:
            raise GenerationError(
                f"{len(group)} sequences of one prompt exceed the batch of {self.limits.max_batch} rows; "
                "ask for fewer choices or raise max_batch"
            )
        if group[0].speculative is not None and self.lane_factory is None:
            raise GenerationError("this scheduler runs no speculative sequences; leave speculative out")
        if not self.queue_room():
            raise QueueFull(
                f"the queue is full ({len(self.waiting)} prompts waiting, at most {self.limits.max_queue}); "
                "retry later or raise max_queue"
            )
        self.waiting.append(group)

    def queue_room(self) -> int:
        """Prompts :meth:`add` takes before the queue is full."""
        return self.limits.max_queue - len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.lanes)

    @property
    def free_rows(self) -> int:
        """Rows a new group may take: the batch's free rows less those lanes and the prefilling group hold."""
        return self.batch.free_rows - len(self.lanes) - len(self.prefilling or [])

    def step(self) -> list[Emitted]:
        """One iteration; what each sequence got in it (a token, or an error), in that order (a sequence
        prefilled in it gets two: its first token, then one from the decode step). A finished sequence
        has ``finish_reason`` set and is no longer scheduled."""
        touched: list[Emitted] = []
        self._open_lanes()
        self._prefill_some(touched)
        self._balance()
        if self.lanes:
            self._step_lanes(touched)
        if self.running:
            self._decode(touched)
        return touched

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Stop ``seq`` wherever it is (queued, prefilling, running or in a lane); its row is freed at once."""
        lane = next((lane for lane in self.lanes if lane.seq is seq), None)
        if lane is not None:
            self._close_lane(lane, finished=False)
        elif seq.slot is not None:
            self._retire(seq)
        else:
            for group in (*self.waiting, self.prefilling or []):
                if seq in group:
                    group.remove(seq)
            if not self.prefilling:
                self.prefilling = None
            self.waiting = deque(group for group in self.waiting if group)
        if seq.finish_reason is None:
            seq.finish_reason = reason

    # -- prefill ----------------------------------------------------------------------------------------
    def _prefill_some(self, touched: list[Emitted]) -> None:
        budget = self.limits.prefill_chunk
        while budget > 0:
            if self.prefilling is None:
                cohort = self._cohort(budget)
                if cohort:
                    budget -= self._prefill_cohort(cohort, touched)
                    continue
                if not self._next_prefill():
                    return
            group = self.prefilling
            assert group is not None
            lead = group[0]  # the group's prompt and progress
            take = self.chunk((self._cuts[0] if self._cuts else lead.prompt_len) - lead.offset)
            ids = lead.ids[None, lead.offset : lead.offset + take]
            try:
                logits = self.session.forward(
                    self._prefill_state, ids, min(self._keep, take), phase="prefill"
                )[0, -1]
                if lead.offset + take == lead.prompt_len:
                    check_model_logits(logits, self.export)
            except OnnxgenError as e:
                self.prefilling = None
                for seq in group:
                    self._fail(seq, str(e), touched)
                continue
            for seq in group:  # any of them may be aborted: each keeps the progress
                seq.offset += take
            budget -= take
            self.prefilled_tokens += take
            if self._cuts and lead.offset == self._cuts[0]:
                self._cuts.pop(0)
                self._cache_prefix(lead.ids[: lead.offset], lead.params.cache_scope)
            if lead.offset == lead.prompt_len:
                self.prefilling = None
                for seq in group:
                    self._start(seq, logits, touched)

    def _cohort(self, budget: int) -> list[list[Sequence]]:
        """Take the waiting groups to prefill as one batched forward: the head group and those behind it
        with prompts of its length, among the groups this step prefills anyway (in queue order while their
        tokens fit ``budget`` and rows are free); empty (nothing taken) where fewer than two qualify."""
        if not self.limits.batch_prefill or self.prefix_cache is not None or self._alone:
            self._alone = max(0, self._alone - 1)
            return []
        self._open_lanes()  # speculative groups at the head take lanes, not a batched prefill's rows
        rows, spent, members = self.free_rows, 0, []
        length = self.waiting[0][0].prompt_len if self.waiting else 0
        if not 2 <= length <= self.limits.prefill_chunk:
            return []
        for group in self.waiting:
            if spent >= budget or len(group) > rows or group[0].speculative is not None:
                break
            rows -= len(group)
            spent += group[0].prompt_len
            if group[0].prompt_len == length:
                members.append(group)
        if len(members) < 2:
            return []
        taken = {id(group) for group in members}
        self.waiting = deque(group for group in self.waiting if id(group) not in taken)
        return members

    def _prefill_cohort(self, cohort: list[list[Sequence]], touched: list[Emitted]) -> int:
        """Prefill ``cohort`` (groups of one prompt length) in one forward, a row each; start each group's
        sequences from its row. Returns the tokens prefilled. A failed forward puts the groups back at
        the head of the queue, to be prefilled one at a time."""
        length = cohort[0][0].prompt_len
        state = self._cohort_state(len(cohort))
        ids = np.stack([group[0].ids[:length] for group in cohort])
        try:
            logits = self.session.forward(state, ids, self._keep, phase="prefill")[:, -1]
        except OnnxgenError:
            log.exception(
                "a batched prefill of %d prompts failed; prefilling them one at a time", len(cohort)
            )
            self.waiting.extendleft(reversed(cohort))
            self._alone = len(cohort)
            return 0
        self.prefilled_tokens += length * len(cohort)
        for row, group in enumerate(cohort):
            for seq in group:
                seq.offset = length
            try:
                check_model_logits(logits[row], self.export)
            except OnnxgenError as e:
                for seq in group:
                    self._fail(seq, str(e), touched)
                continue
            for seq in group:
                self._start(seq, logits[row], touched, state, row)
        return length * len(cohort)

    def _cohort_state(self, rows: int) -> DecodeState:
        """An emptied decode state of ``rows`` rows for a batched prefill (kept for the next batch of as
        many rows; others are dropped where the kept ones would hold more rows than the batch)."""
        state = self._cohort_states.get(rows)
        if state is None:
            if sum(self._cohort_states) + rows > self.limits.max_batch:
                self._cohort_states.clear()
            state = self._cohort_states[rows] = self.session.new_state(self.limits.max_model_len, rows)
        state.reset()
        return state

    def _next_prefill(self) -> bool:
        """Take the next waiting group to prefill (whether one could: it needs a free row per sequence),
        resumed from its longest cached prefix."""
        self._open_lanes()
        if not self.waiting or len(self.waiting[0]) > self.free_rows:
            return False
        self.prefilling = group = self.waiting.popleft()
        self._prefill_state.reset()
        self._cuts = []
        cache = self.prefix_cache
        if cache is None:
            return True
        try:
            hit = cache.lookup(group[0].prompt, scope=group[0].params.cache_scope)
            cache.restore(hit, self._prefill_state)
        except Exception:  # the cache must never fail a request: prefill it all instead
            log.exception("prefix cache lookup failed; prefilling the whole prompt")
            self._prefill_state.reset()
            return True
        for seq in group:
            seq.offset = seq.cached_tokens = hit.tokens
        self._cuts = cache.cuts(group[0].prompt_len, hit.tokens, hit.matched)
        return True

    def _cache_prefix(self, tokens: np.ndarray, scope: str) -> None:
        assert self.prefix_cache is not None
        try:
            self.prefix_cache.insert_state(tokens, self._prefill_state, scope=scope)
        except Exception:  # the cache must never fail a request
            log.exception("caching a prompt prefix failed; it is not cached")

    def _cache_row(self, seq: Sequence) -> None:
        """Cache a finished row's sequence (the tokens its state has run) before it is retired."""
        row, cache = seq.slot, self.prefix_cache
        assert row is not None
        length = int(self.batch.lengths[row])
        if cache is None or not 0 < length <= seq.n:
            return
        try:
            cache.insert_arrays(
                seq.ids[:length], self.batch.row_kv(row), self.batch.row_states(row), seq.params.cache_scope
            )
        except Exception:
            log.exception("caching a finished sequence failed; it is not cached")

    def chunk(self, left: int) -> int:
        """The next prefill chunk of a prompt with ``left`` tokens to go (:func:`prefill_cut`)."""
        return prefill_cut(left, self.limits.prefill_chunk)

    def _start(
        self,
        seq: Sequence,
        logits: np.ndarray,
        touched: list[Emitted],
        state: DecodeState | None = None,
        row: int = 0,
    ) -> None:
        """Choose the first token of ``seq``, prefilled in row ``row`` of ``state`` (None: the prefill
        state); give it a batch row unless that token finished it."""
        if not self._choose(seq, logits, touched):
            return
        start = time.perf_counter()
        seq.slot = self.batch.admit(self._prefill_state if state is None else state, row)
        self.copy_seconds += time.perf_counter() - start
        self.running.append(seq)
        if seq.speculative is not None:  # a greedy one that came with plain company: it starts as a row
            self.yields += 1

    # -- lanes ------------------------------------------------------------------------------------------
    def _open_lanes(self) -> None:
        """Give the speculative groups at the head of the queue a lane per sequence, while rows are free
        (those that may yield only without plain company: with it they are prefilled as rows)."""
        while self.waiting and self.waiting[0][0].speculative is not None:
            if len(self.waiting[0]) > self.free_rows:
                return
            if self.waiting[0][0].may_yield and self._plain_company():
                return
            assert self.lane_factory is not None
            for seq in self.waiting.popleft():
                self.lanes.append(self.lane_factory.open(seq))

    def _plain_company(self) -> bool:
        """Whether plain sequences decode in the batch now or are about to (their prompt prefilling)."""
        prefilling = self.prefilling is not None and self.prefilling[0].speculative is None
        return prefilling or any(seq.speculative is None for seq in self.running)

    def _balance(self) -> None:
        """Move speculative sequences that may yield between their lanes and batch rows: into rows at once when
        plain company is there, back into lanes after ``RESUME_AFTER`` iterations without it."""
        if self._plain_company():
            self._quiet = 0
            for lane in [lane for lane in self.lanes if lane.movable and lane.started]:
                self._park(lane)
            return
        self._quiet += 1
        if self._quiet >= RESUME_AFTER:
            for seq in [seq for seq in self.running if self._movable_row(seq)]:
                self._unpark(seq)

    def _movable_row(self, seq: Sequence) -> bool:
        return seq.may_yield and seq not in self.rows_only

    def _park(self, lane: Lane) -> None:
        """Move a started lane's sequence (no token held back, its state at the pending token) into a row."""
        seq = lane.seq
        seq.slot = self.batch.admit(lane.loop.state)
        self.lanes.remove(lane)
        self.running.append(seq)
        self.parked[seq] = lane
        lane.yields += 1
        self.yields += 1

    def _unpark(self, seq: Sequence) -> None:
        """Move a speculative sequence from its batch row into its lane (opened now if it started as a row)."""
        lane = self.parked.pop(seq, None)
        if lane is None:  # it started as a row
            assert self.lane_factory is not None
            lane = self.lane_factory.open(seq, resume=False)
            lane.yields = 1
        row = seq.slot
        assert row is not None
        try:
            lane.adopt(lambda state: self.batch.load_row(row, state))
        except (OnnxgenError, ValueError):  # it goes on in its row, which holds its state as it was
            log.exception("moving a speculative sequence into its lane failed; it stays a batch row")
            self.rows_only.add(seq)
            assert self.lane_factory is not None
            self.lane_factory.close(lane, finished=False)
            return
        self._free_row(seq)
        self.lanes.append(lane)
        self.resumes += 1

    def _step_lanes(self, touched: list[Emitted]) -> None:
        for lane in list(self.lanes):
            try:
                self._lane_tokens(lane, touched)
            except OnnxgenError as e:  # its prompt's logits, its constraint: it fails alone
                self._close_lane(lane, finished=False)
                self._fail(lane.seq, str(e), touched, client=isinstance(e, ConstraintError))
                continue
            if lane.seq.finish_reason is not None:
                self._close_lane(lane, finished=True)

    def _lane_tokens(self, lane: Lane, touched: list[Emitted]) -> None:
        """The tokens of one forward of ``lane`` (a verify's accepted drafts and the token after them;
        the first call also runs the prompt)."""
        seq, loop = lane.seq, lane.loop
        while True:
            token, reason = lane.next()
            if seq.generated == 0:
                seq.cached_tokens = loop.cached_tokens
                self.prefilled_tokens += seq.prompt_len - loop.cached_tokens
            if seq.scores is not None and loop.scores is not None:
                seq.scores.append(loop.scores[len(seq.scores)])
            text, reason = seq.put(token, reason)
            touched.append(Emitted(seq, token, text, reason, seq.last_score))
            if reason is not None or not lane.ready:
                return

    def _close_lane(self, lane: Lane, finished: bool) -> None:
        self.lanes.remove(lane)
        assert self.lane_factory is not None
        self.lane_factory.close(lane, finished)

    # -- decode -----------------------------------------------------------------------------------------
    def _decode(self, touched: list[Emitted]) -> None:
        start = time.perf_counter()
        try:
            logits = self.batch.step([seq.last_token for seq in self.running])
            self.last_decode = (len(self.running), time.perf_counter() - start)
        except OnnxgenError as e:
            for seq in list(self.running):
                self._retire(seq)
                self._fail(seq, str(e), touched)
            return
        for row, seq in enumerate(list(self.running)):
            self._choose(seq, logits[row], touched)
        for seq in [s for s in reversed(self.running) if s.finish_reason is not None]:
            self._cache_row(seq)
            self._retire(seq)

    def _choose(self, seq: Sequence, logits: np.ndarray, touched: list[Emitted]) -> bool:
        """Add ``seq``'s next token from ``logits``; whether it goes on."""
        try:
            token = seq.select(logits, self.export)
            text, reason = seq.add(token)
        except OnnxgenError as e:  # e.g. every token masked by the request's own filters
            self._fail(seq, str(e), touched, client=isinstance(e, ConstraintError))
            return False
        touched.append(Emitted(seq, token, text, reason, seq.scores[-1] if seq.scores else None))
        return reason is None

    # -- endings ----------------------------------------------------------------------------------------
    def _retire(self, seq: Sequence) -> None:
        """Free ``seq``'s row for good (a yielded speculative sequence's lane closes with it)."""
        self._free_row(seq)
        self.rows_only.discard(seq)
        lane = self.parked.pop(seq, None)
        if lane is not None:
            assert self.lane_factory is not None
            self.lane_factory.close(lane, seq.finish_reason not in (None, "error"), cache=False)
        elif seq.speculative is not None:  # it started as a row and never had a lane
            seq.extra_stats = {"speculation_yields": 1, "batch_row_tokens": seq.generated}

    def _free_row(self, seq: Sequence) -> None:
        """Free ``seq``'s row; the last row moves into it (the batch keeps its rows contiguous)."""
        row = seq.slot
        assert row is not None and self.running[row] is seq
        start = time.perf_counter()
        self.batch.retire(row)
        self.copy_seconds += time.perf_counter() - start
        last = self.running.pop()
        if last is not seq:
            self.running[row] = last
            last.slot = row
        seq.slot = None

    def _fail(self, seq: Sequence, message: str, touched: list[Emitted], client: bool = False) -> None:
        if seq.slot is not None:
            self._retire(seq)
        seq.finish_reason = "error"
        seq.error = message
        seq.client_error = client
        touched.append(Emitted(seq, -1, "", "error", None))
