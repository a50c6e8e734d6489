"""The server's worker: one thread drives the :class:`~onnxgen.engine.engine.Engine`; the asyncio side only
queues and streams.

Each iteration of the worker

1. ends the requests of gone clients (their rows are freed, their queue places given back);
2. hands the engine the jobs submitted since (each prompt's choices, prefilled once);
3. runs one engine step (chunked prefill from the prefix cache's longest hit, one batched decode forward,
   retirement: :mod:`onnxgen.engine.scheduler`) and pushes each request the deltas it got, updating the
   metrics and, once a prompt is prefilled, the request's count of cached prompt tokens.

The wait queue is bounded: :meth:`Scheduler.submit` raises :class:`QueueFull` when it is full.
"""

from __future__ import annotations

import logging
import threading
import time

from onnxgen.config import env_step_trace
from onnxgen.engine.engine import Engine, RequestOutput
from onnxgen.engine.limits import BatchLimits
from onnxgen.errors import OnnxgenError
from onnxgen.llm import LLM
from onnxgen.server.metrics import ServerMetrics
from onnxgen.server.sequence import Delta, Handle, Job, SequenceRun
from onnxgen.server.trace import StepTrace

log = logging.getLogger(__name__)

SchedulerConfig = BatchLimits  # the server's name for them


class QueueFull(OnnxgenError):
    """The server's wait queue is full; the client should retry later."""


class Scheduler:
    """Queues jobs and runs the engine on its own thread, one step at a time."""

    def __init__(self, llm: LLM, config: SchedulerConfig, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.config = config
        self.metrics = metrics
        self.engine = Engine(llm.generator, config, llm.draft_generator)
        self._jobs: dict[int, Job] = {}  # the engine's requests (by id(job))
        self._incoming: list[Job] = []  # submitted, not yet handed to the engine
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        metrics.rows(0, config.max_batch)
        trace = env_step_trace()
        self.trace = StepTrace(trace) if trace else None  # the per-iteration timing trace, if asked for
        if self.trace is not None:
            llm.session.forward_observer = self.trace.observe

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
            waiting = len(self._incoming) + len(self.engine.scheduler.waiting)
            if waiting + len(jobs) > self.config.max_queue:
                raise QueueFull(
                    f"the server's queue is full ({waiting} prompts waiting, at most "
                    f"{self.config.max_queue}); retry later"
                )
            self._incoming.extend(jobs)
            self.metrics.queue_depth.set(waiting + len(jobs))
            self._cv.notify()

    def wake(self) -> None:
        """Have the worker look at the requests again (a client went away)."""
        with self._cv:
            self._cv.notify()

    # -- worker thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            waited = time.perf_counter()
            with self._cv:
                while not self._stopping and not (self._incoming or self.engine.has_unfinished()):
                    self._cv.wait()
                if self._stopping:
                    break
            if self.trace is not None:
                self.trace.begin(time.perf_counter() - waited)
            try:
                self._iteration()
            except Exception as e:  # never let one bad step take the server down
                log.exception("scheduler iteration failed")
                self._fail_all(f"the engine failed: {e}")
        self._fail_all("the server is shutting down")
        if self.trace is not None:
            self.trace.close()

    def _iteration(self) -> None:
        trace = self.trace
        self._end_cancelled()
        self._take_incoming()
        scheduler = self.engine.scheduler
        prefilled, yields, resumes = scheduler.prefilled_tokens, scheduler.yields, scheduler.resumes
        scheduler.last_decode = (0, 0.0)
        rows_in, copied = scheduler.batch.n, scheduler.copy_seconds
        if trace is not None:
            trace.lap("take")
        outputs = self.engine.step()
        if trace is not None:
            trace.lap("step")
        self.metrics.prompt_tokens.inc(scheduler.prefilled_tokens - prefilled)
        self.metrics.speculative_yields.inc(scheduler.yields - yields)
        self.metrics.speculative_resumes.inc(scheduler.resumes - resumes)
        rows, seconds = scheduler.last_decode
        if rows:
            self.metrics.batch_size.observe(rows)
            self.metrics.step_seconds.observe(seconds)
        # the gauges are set before the outputs reach clients (a client that reads /metrics after its
        # last token sees its row gone), and again after: pushing can end rows (stop strings)
        self._set_gauges()
        self._push(outputs)
        self._set_gauges()
        if trace is not None:
            trace.lap("push")
            copy = round(scheduler.copy_seconds - copied, 6)
            waiting = len(scheduler.waiting)
            trace.end(
                copy=copy, rows_in=rows_in, rows=scheduler.batch.n, waiting=waiting, jobs=len(self._jobs)
            )

    def _set_gauges(self) -> None:
        scheduler = self.engine.scheduler
        self.metrics.rows(scheduler.batch.n, scheduler.batch.free_rows)
        self.metrics.queue_depth.set(len(scheduler.waiting) + len(self._incoming))

    def _take_incoming(self) -> None:
        with self._cv:
            jobs, self._incoming = self._incoming, []
        for job in jobs:
            if job.cancelled:
                self._count_finished(job.runs, "cancelled")
                continue
            try:
                self.engine.add_sequences(id(job), list(job.runs))
            except OnnxgenError as e:  # refused by the engine: this job fails, the others go on
                self._count_finished(job.runs, "error")
                job.handle.push([Delta(run.index, -1, "", "error", str(e)) for run in job.runs])
                continue
            self._jobs[id(job)] = job

    def _end_cancelled(self) -> None:
        """Gone clients' requests: their rows freed and their queue places given back (no deltas)."""
        for key, job in list(self._jobs.items()):
            if job.cancelled:
                self.engine.abort(key)
                self._count_finished([r for r in job.runs if r.finish_reason == "abort"], "cancelled")
                del self._jobs[key]

    def _push(self, outputs: list[RequestOutput]) -> None:
        pushes: dict[Handle, list[Delta]] = {}
        for out in outputs:
            job = self._jobs[int(out.request_id)]
            run = job.runs[out.index]
            if not job.started and self.llm.prefix_cache is not None:
                job.started = True  # (before its first deltas: usage reads the count at the end)
                job.handle.cached_tokens = (job.handle.cached_tokens or 0) + run.cached_tokens
            pushes.setdefault(job.handle, []).append(self._delta(job, run, out))
        for handle, deltas in pushes.items():
            handle.push(deltas)
        for key in [key for key, job in self._jobs.items() if not self.engine.sequences(key)]:
            del self._jobs[key]

    def _delta(self, job: Job, run: SequenceRun, out: RequestOutput) -> Delta:
        """``out`` as the delta of choice ``run``, with the metrics it brings."""
        if out.error is not None:
            self._count_finished([run], "error")
            return Delta(run.index, -1, "", "error", out.error, run.client_error)
        self.metrics.generation_tokens.inc()
        # a choice prefilled in this step got two tokens in it: its first (at first_token_at), then one
        if run.emitted == 0:
            self.metrics.ttft.observe(run.first_token_at - job.arrived)
            run.previous_at = run.first_token_at
        else:
            self.metrics.per_token.observe(run.last_token_at - run.previous_at)
            run.previous_at = run.last_token_at
        run.emitted += 1
        if out.finish_reason is not None:
            self._count_finished([run], out.finish_reason)
            self.metrics.e2e.observe(time.perf_counter() - job.arrived)
        logprob = out.logprobs[0] if out.logprobs else None
        return Delta(run.index, out.token_ids[0], out.text, out.finish_reason, logprob=logprob)

    def _count_finished(self, runs: list[SequenceRun], reason: str) -> None:
        for _ in runs:
            self.metrics.finished.labels(reason).inc()

    def _fail_all(self, message: str) -> None:
        """End every request with an error delta (the engine failed, or the server is stopping)."""
        with self._cv:
            incoming, self._incoming = self._incoming, []
            self.metrics.queue_depth.set(0)
        jobs = [*self._jobs.items(), *((id(job), job) for job in incoming)]
        self._jobs.clear()
        for key, job in jobs:
            self.engine.abort(key)
            runs = [run for run in job.runs if run.finish_reason in (None, "abort")]
            for run in runs:
                run.finish_reason = "error"
            self._count_finished(runs, "error")
            if runs:
                job.handle.push([Delta(run.index, -1, "", "error", message) for run in runs])
