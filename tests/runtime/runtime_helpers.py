"""Helpers of the runtime tests: family specs, DecoderSessions over tiny models, greedy and teacher-forced runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from onnxgen.model import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState
from onnxgen.testing import TinySpec

DENSE = TinySpec()
HYBRID = TinySpec.hybrid()
DENSE_FAMILIES = ("genai-dense", "standard-dense")
HYBRID_FAMILIES = ("hybrid-genai", "hybrid-mobius", "hybrid-scan")
PROMPT = [5, 17, 200, 33, 44, 91, 12, 8]


def spec_of(family: str) -> TinySpec:
    return HYBRID if family.startswith("hybrid") else DENSE


def open_session(model_dir: Path, *, shared_kv: bool | None = None) -> DecoderSession:
    """A one-thread DecoderSession; ``shared_kv`` overrides the derived past_present_share_buffer."""
    io = ModelPackage.open(model_dir).io
    if shared_kv is not None:
        io = dataclasses.replace(io, past_present_share_buffer=shared_kv)
    return DecoderSession(session_graph(model_dir / "model.onnx", io), threads=1)


def ids(tokens: list[int] | int) -> np.ndarray:
    """A [1, T] batch of token ids."""
    return np.asarray([[tokens]] if isinstance(tokens, int) else [tokens], dtype=np.int64)


def prefilled(session: DecoderSession, capacity: int = 64, prompt: list[int] = PROMPT) -> DecodeState:
    """A new state of ``capacity`` positions after a forward over ``prompt``."""
    state = session.new_state(capacity)
    session.forward(state, ids(prompt))
    return state


def greedy_run(
    session: DecoderSession, state: DecodeState, prompt: list[int], steps: int
) -> tuple[list[int], np.ndarray]:
    """Prefill then ``steps`` argmax decode steps; returns (generated tokens, last-position logits per forward)."""
    rows = [session.forward(state, ids(prompt))[0, -1]]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(session.forward(state, ids(tokens[-1]))[0, -1])
    return tokens, np.stack(rows)


def teacher_forced(
    session: DecoderSession, state: DecodeState, prompt: list[int], continuation: list[int]
) -> np.ndarray:
    """Prefill then feed ``continuation`` one token per step; last-position logits per forward."""
    rows = [session.forward(state, ids(prompt))[0, -1]]
    rows += [session.forward(state, ids(token))[0, -1] for token in continuation]
    return np.stack(rows)
