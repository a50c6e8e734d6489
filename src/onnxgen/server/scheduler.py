"""Continuous batching: one worker thread runs the model; the asyncio side only queues and streams.

Each iteration of the worker:

1. retires the rows of cancelled requests (client gone), freeing their slots;
2. prefills waiting prompts alone (batch 1, in chunks of at most ``prefill_chunk`` tokens per
   iteration so running rows keep streaming), samples each choice's first token and copies the
   prefilled KV and recurrent states into a free batch row per choice;
3. runs one batched decode step over every running row and retires the rows that finished.

The wait queue is bounded: :meth:`Scheduler.submit` raises :class:`QueueFull` when it is full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from onnxgen.errors import OnnxgenError
from onnxgen.generation.constraints import ConstraintError
from onnxgen.generation.sampling import check_model_logits
from onnxgen.llm import LLM
from onnxgen.runtime.batch import BatchState
from onnxgen.server.metrics import ServerMetrics
from onnxgen.server.sequence import Delta, Handle, Job, SequenceRun

log = logging.getLogger(__name__)


class QueueFull(OnnxgenError):
    """The server's wait queue is full; the client should retry later."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How many sequences decode together and how much may wait.

    Attributes:
        max_batch: batch rows, i.e. choices decoded together.
        max_queue: prompts that may wait for a row before new requests are refused.
        max_model_len: tokens per row (prompt + generated).
        prefill_chunk: prompt tokens per prefill forward (also the budget between two decode steps); at
            least 2, so that no prefill forward but a one-token prompt's runs the single-token path.
        min_rows: every decode step runs at least this many rows (idle ones pad it), so that kernels
            that compute one row differently from several (int4 MatMulNBits with int8 activations)
            give a sequence the same tokens whether it decodes alone or beside others.
    """

    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 2048
    prefill_chunk: int = 512
    min_rows: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "max_model_len", "prefill_chunk", "min_rows"):
            value, least = getattr(self, name), 2 if name in ("max_model_len", "prefill_chunk") else 1
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least} (got {value!r})")


class Scheduler:
    """Queues jobs, prefills them one at a time and decodes every running row in one forward per step."""

    def __init__(self, llm: LLM, config: SchedulerConfig, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.config = config
        self.metrics = metrics
        self.batch = BatchState(llm.session, config.max_batch, config.max_model_len, config.min_rows)
        self._prefill_state = llm.session.new_state(config.max_model_len)
        self._rows: list[tuple[Job, SequenceRun]] = []  # aligned with the batch rows
        self._waiting: deque[Job] = deque()
        self._prefill: Job | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        metrics.free_rows.set(config.max_batch)

    # -- asyncio side -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="onnxgen-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (the prompts of one request) or raise :class:`QueueFull`."""
        with self._cv:
            if len(self._waiting) + len(jobs) > self.config.max_queue:
                raise QueueFull(
                    f"the server's queue is full ({len(self._waiting)} prompts waiting, at most "
                    f"{self.config.max_queue}); retry later"
                )
            self._waiting.extend(jobs)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()

    def wake(self) -> None:
        """Have the worker look at the requests again (a client went away)."""
        with self._cv:
            self._cv.notify()

    # -- worker thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not (self._waiting or self._prefill or self.batch.n):
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self._iteration()
            except Exception as e:  # never let one bad step take the server down
                log.exception("scheduler iteration failed")
                self._fail_all(f"the engine failed: {e}")
        self._fail_all("the server is shutting down")

    def _iteration(self) -> None:
        self._retire_cancelled()
        self._prefill_some()
        if self.batch.n:
            self._decode_step()
        self.metrics.running.set(self.batch.n)
        self.metrics.free_rows.set(self.batch.free_rows)

    def _next_job(self) -> Job | None:
        with self._cv:
            if any(job.cancelled for job in self._waiting):  # gone clients give their queue places back
                for job in [job for job in self._waiting if job.cancelled]:
                    self._finish_unstarted(job, "cancelled")
                self._waiting = deque(job for job in self._waiting if not job.cancelled)
            job = None
            if self._waiting and len(self._waiting[0].runs) <= self.batch.free_rows:
                job = self._waiting.popleft()
            self.metrics.queue_depth.set(len(self._waiting))
            return job

    def _prefill_some(self) -> None:
        budget = self.config.prefill_chunk
        while budget > 0:
            if self._prefill is None:
                self._prefill = self._next_job()
                if self._prefill is None:
                    return
                self._prefill_state.reset()
            job = self._prefill
            if job.cancelled:
                self._prefill = None
                self._finish_unstarted(job, "cancelled")
                continue
            take = self._chunk(job)
            ids = np.asarray([job.prompt[job.offset : job.offset + take]], dtype=np.int64)
            try:
                logits = self.llm.session.forward(self._prefill_state, ids, 1)[0, -1]
                if job.offset + take == len(job.prompt):
                    check_model_logits(logits, self.llm.generator.export)
            except OnnxgenError as e:
                self._prefill = None
                self._fail(job, job.runs, str(e))
                continue
            job.offset += take
            budget -= take
            self.metrics.prompt_tokens.inc(take)
            if job.offset == len(job.prompt):
                self._prefill = None
                self._start(job, logits)

    def _chunk(self, job: Job) -> int:
        """The next prefill chunk of ``job``: cut at fixed offsets (multiples of ``prefill_chunk``) whatever
        else the iteration prefills, and never a lone last token (a one-token forward takes the
        single-token path, which rounds differently): where one would be left, the last cut moves back
        by one, or with chunks of 2 the last chunk takes 3."""
        chunk, left = self.config.prefill_chunk, len(job.prompt) - job.offset
        if left <= chunk:
            return left
        if left == chunk + 1:
            return chunk - 1 if chunk > 2 else left
        return chunk

    def _start(self, job: Job, logits: np.ndarray) -> None:
        """Sample each choice's first token and give every unfinished choice a batch row."""
        deltas = []
        for run in job.runs:
            delta = self._choose(run, logits)
            self.metrics.ttft.observe(run.last_token_at - job.arrived)
            deltas.append(delta)
            if delta.finish_reason is None:
                self.batch.admit(self._prefill_state)
                self._rows.append((job, run))
            else:
                self._finished(job, run, delta.finish_reason)
        self.metrics.generation_tokens.inc(len(deltas))
        job.handle.push(deltas)

    def _choose(self, run: SequenceRun, logits: np.ndarray) -> Delta:
        try:
            return run.add(run.select(logits))
        except OnnxgenError as e:  # e.g. every token masked by the request's own filters
            run.finish_reason = "error"
            return Delta(run.index, -1, "", "error", str(e), isinstance(e, ConstraintError))

    def _decode_step(self) -> None:
        n = self.batch.n
        start = time.perf_counter()
        try:
            logits = self.batch.step([run.last_token for _, run in self._rows])
        except OnnxgenError as e:
            for job, run in list(self._rows):
                self._fail(job, [run], str(e))
            return
        self.metrics.batch_size.observe(n)
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        pushes: dict[Handle, list[Delta]] = {}
        for row, (job, run) in enumerate(self._rows):
            previous = run.last_token_at
            delta = self._choose(run, logits[row])
            self.metrics.per_token.observe(run.last_token_at - previous)
            pushes.setdefault(job.handle, []).append(delta)
        self.metrics.generation_tokens.inc(n)
        for row in reversed(range(n)):
            job, run = self._rows[row]
            if run.finish_reason is not None:
                self._retire(row)
                self._finished(job, run, run.finish_reason)
        for handle, deltas in pushes.items():
            handle.push(deltas)

    # -- endings ----------------------------------------------------------------------------------------
    def _retire(self, row: int) -> None:
        self.batch.retire(row)
        last = self._rows.pop()
        if row < len(self._rows):
            self._rows[row] = last

    def _retire_cancelled(self) -> None:
        for row in reversed(range(self.batch.n)):
            job, run = self._rows[row]
            if job.cancelled:
                self._retire(row)
                self._finished(job, run, "cancelled")

    def _finished(self, job: Job, run: SequenceRun, reason: str) -> None:
        self.metrics.finished.labels(reason).inc()
        if reason != "cancelled":
            self.metrics.e2e.observe(time.perf_counter() - job.arrived)

    def _finish_unstarted(self, job: Job, reason: str) -> None:
        for _ in job.runs:
            self.metrics.finished.labels(reason).inc()

    def _fail(self, job: Job, runs: list[SequenceRun], message: str) -> None:
        """End ``runs`` of ``job`` with an error delta (rows they hold are retired)."""
        for row in reversed(range(self.batch.n)):
            if self._rows[row][0] is job and self._rows[row][1] in runs:
                self._retire(row)
        for run in runs:
            run.finish_reason = "error"
            self.metrics.finished.labels("error").inc()
        job.handle.push([Delta(run.index, -1, "", "error", message) for run in runs])

    def _fail_all(self, message: str) -> None:
        in_flight: dict[int, tuple[Job, list[SequenceRun]]] = {}
        for job, run in self._rows:
            in_flight.setdefault(id(job), (job, []))[1].append(run)
        if self._prefill is not None:
            in_flight[id(self._prefill)] = (self._prefill, self._prefill.runs)
            self._prefill = None
        with self._cv:
            while self._waiting:
                job = self._waiting.popleft()
                in_flight[id(job)] = (job, job.runs)
            self.metrics.queue_depth.set(0)
        for job, runs in in_flight.values():
            self._fail(job, runs, message)
