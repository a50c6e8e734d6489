"""The forward observer: a public hook that sees every forward a :class:`~onnxgen.runtime.session.DecoderSession`
runs, for timing and counting (``onnxgen bench`` installs one; nothing else does).

Install it with ``llm.session.forward_observer = callback`` (``None`` removes it). The session calls
``callback(ForwardEvent(...))`` after each forward: prefill chunks, single-token decode steps (on the
prepared lane or not), speculative verifies, and batched decode steps of a
:class:`~onnxgen.runtime.batch.BatchState` (one event per step, ``batch`` its live rows). The callback runs
on the forward's thread, between forwards: it should be quick and must not run forwards itself. With no
observer installed a forward pays one attribute test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode", "verify"]


@dataclass(frozen=True)
class ForwardEvent:
    """One forward: its phase, shape, where it started and its wall time.

    ``phase`` follows from the forward's shape: ``decode`` feeds one token per row; ``verify`` feeds
    several and reads the logits of more than one position (a speculative verify of drafted tokens);
    ``prefill`` feeds several and reads the last position's (a prompt or a chunk of one, and the replay of
    accepted tokens after a rejected verify, which runs as a prefill does)."""

    phase: Phase
    batch: int  # rows run (live rows of a batched step)
    tokens: int  # tokens fed per row
    past: int  # tokens the state held before (a batch's longest row)
    seconds: float  # wall time of the forward, binding and run


ForwardObserver = Callable[[ForwardEvent], None]


def phase_of(tokens: int, logits: int) -> Phase:
    """The phase of a forward feeding ``tokens`` tokens per row and reading ``logits`` positions' logits."""
    if tokens == 1:
        return "decode"
    return "verify" if logits > 1 else "prefill"
