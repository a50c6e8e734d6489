"""The server's step trace: one JSON line per worker iteration, for finding where a loaded server's time goes.

Off unless ``$ONNXGEN_STEP_TRACE`` names a file (:func:`onnxgen.config.env_step_trace`). Each line holds
the iteration's start (``t``, Unix seconds, so a client's clock can cut the trace into its load levels),
the worker's wait for work before it (``idle``), the seconds spent taking new requests (``take``), in the
engine's step (``step``) and pushing the deltas (``push``); within the step each forward as ``[phase, rows,
tokens per row, seconds]`` (``fw``: prefill chunks, the batched decode step) and the seconds spent copying
states into and out of batch rows (``copy``); then the batch's rows before and after the step
(``rows_in``, ``rows``), the prompts waiting (``waiting``) and the requests in the engine (``jobs``).
``scripts/serve_trace.py`` sums a trace into a table. Tracing costs a clock read per phase and one
written line per iteration.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

from onnxgen.runtime.observer import ForwardEvent


class StepTrace:
    """Collects one iteration's timings and writes them as a JSON line."""

    def __init__(self, path: str | Path) -> None:
        self._file: IO[str] = Path(path).open("a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self.forwards: list[list[Any]] = []
        self.record: dict[str, Any] = {}
        self._mark = time.perf_counter()

    def observe(self, event: ForwardEvent) -> None:
        """The session's forward observer while tracing."""
        self.forwards.append([event.phase, event.batch, event.tokens, round(event.seconds, 6)])

    def begin(self, idle: float) -> None:
        """An iteration starts, after the worker waited ``idle`` seconds for work."""
        self.forwards = []
        self.record = {"t": round(time.time(), 6), "idle": round(idle, 6)}
        self._mark = time.perf_counter()

    def lap(self, name: str) -> None:
        """Record the seconds since the last mark as ``name``."""
        now = time.perf_counter()
        self.record[name] = round(now - self._mark, 6)
        self._mark = now

    def end(self, **fields: Any) -> None:
        """Write the iteration with ``fields`` (its rows, queue and copy seconds)."""
        self.record["fw"] = self.forwards
        self.record.update(fields)
        self._file.write(json.dumps(self.record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
