"""Whether a speculative verify computes the same bits as the decode steps it stands for, on this CPU.

A verify runs the pending token and its drafts through one forward of several positions; plain decoding
runs the same tokens one step each. Greedy speculation emits exactly plain decoding's tokens only if each
verify row's logits (and the KV rows and recurrent states the verify leaves) are the bits those steps give.
Some kernels take another path for one query row than for several: onnxruntime's CPU attention multiplies
the attention probabilities by V with a single-row SGEMM kernel when a forward has one token and with the
blocked kernel otherwise, so a verify row differs from its step in the last bits. In an fp32 model that
rarely changes a token; in an int4 export whose ``MatMulNBits`` quantize activations to int8 the difference
is amplified layer by layer until it does (a token tens of positions in).

:func:`check_verify` runs that comparison once per session (a 3-token prompt, then 4 tokens as steps and as
one verify, then one more step each), so the engine speculates only where the output stays exact.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from onnxgen.runtime.session import DecoderSession

PROBE_WIDTH = 4  # tokens one probe verify covers (any width above one takes the multi-row kernels)


@dataclass(frozen=True)
class VerifyCheck:
    """A verify forward against single steps on this session: equal bit for bit, or where they differ."""

    exact: bool
    detail: str


_LOCK = threading.Lock()
# each session's last check and the session epoch (graph) it was made on
_CHECKS: weakref.WeakKeyDictionary[DecoderSession, tuple[int, VerifyCheck]] = weakref.WeakKeyDictionary()


def check_verify(session: DecoderSession) -> VerifyCheck:
    """The session's :class:`VerifyCheck`, probed on its first call (and again after the session's graph is
    replaced, e.g. by the verify plan's); later calls return the cached result."""
    with _LOCK:
        cached = _CHECKS.get(session)
        if cached is not None and cached[0] == session.epoch:
            return cached[1]
        check = verify_matches_steps(session, session.serial_width or PROBE_WIDTH)
        _CHECKS[session] = (session.epoch, check)
        return check


def verify_matches_steps(session: DecoderSession, width: int = PROBE_WIDTH) -> VerifyCheck:
    """Decode ``width`` tokens after a short prompt as single steps and as one verify forward, then one
    more step after each: equal logits at every position, bit for bit (the step after the verify reads the
    KV rows and recurrent states the verify wrote)."""
    vocab = session.vocab_size if session.vocab_size > 0 else 8
    prompt = np.array([[3 % vocab, 11 % vocab, 29 % vocab]], dtype=np.int64)
    tokens = [(40 + 13 * i) % vocab for i in range(width + 1)]
    capacity = prompt.shape[1] + width + 2

    steps = session.new_state(capacity)
    session.forward(steps, prompt, 1)
    ref = [session.step(steps, t).copy() for t in tokens]

    verify = session.new_state(capacity)
    session.forward(verify, prompt, 1)
    rows = session.forward(verify, np.array([tokens[:width]], dtype=np.int64))[0]
    after = session.step(verify, tokens[width]).copy()
    got = [*rows, after]
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if not np.array_equal(a, b):
            where = "the step after the verify" if i == width else f"verify row {i}"
            return VerifyCheck(
                False,
                f"{where} differs from its single step by up to {float(np.max(np.abs(a - b))):.3g} "
                f"(a {width}-token verify on this CPU's kernels)",
            )
    return VerifyCheck(True, f"a {width}-token verify equals its single steps bit for bit")
