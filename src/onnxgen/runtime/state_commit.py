"""Verify plans: commit a hybrid model's recurrent states to an accepted draft prefix without a replay.

After a speculative verify forward over T tokens (the pending token and T-1 drafts) accepts only some
drafts, the model must hold exactly the first ``kept`` tokens. KV caches are rewound by length; recurrent
states cannot be (docs/speculative-commit.md). The universal answer, strategy (a), restores the states saved
before the verify and replays the kept tokens: a second forward. A verify plan avoids that forward:

- :class:`CapturePlan`, strategy (c), every export family: the graph also returns the per-token inputs of
  the nodes that update the states (:mod:`onnxgen.graph.state_capture`); commit re-runs only those nodes
  over the kept tokens from the states saved before the verify (a small weightless graph, host copies for
  conv windows).
- :class:`PerPositionPlan`, strategy (b): the graph returns each state after every position (Scan exports:
  :mod:`onnxgen.graph.scan_state_window`; fused exports on CUDA: :mod:`onnxgen.graph.fused_state_window`);
  commit copies the kept position's state, one copy per state. Its outputs hold T copies of every state
  for *every* forward of T tokens, prefill included (a 512-token prefill of a 6-layer, 128 KB-state model
  holds 384 MB more), so "auto" picks it only for the CUDA state window, which is bounded by W <= 8.

The rewritten graph only gains outputs, so one session serves every forward: ordinary forwards do not
fetch the extra outputs, verify forwards do (``DecoderSession.forward(..., fetch=, fetched=)``). Those
outputs still cost every forward (a measurable share of a plain step), so a ``DecoderSession`` loads the
rewritten graph only when its plan is first asked for (the first speculative verify) and runs the plain
graph until then. Plans bind the same state buffers by the same port names as every other forward: state
continuity is by name.
docs/speculative-commit.md has the measurements behind the choice.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from onnxgen.graph.fused_state_window import emit_fused_state_window
from onnxgen.graph.scan_state_window import emit_scan_states
from onnxgen.graph.state_capture import (
    CaptureReport,
    capture_state_inputs,
    commit_graph,
    conv_state_after,
    cut_tokens,
)
from onnxgen.graph.state_window import PerPosition
from onnxgen.model.io import DecoderIO
from onnxgen.runtime.state import DecodeState, Snapshot

log = logging.getLogger(__name__)

_ELEM_TYPES = {"tensor(float)": onnx.TensorProto.FLOAT, "tensor(float16)": onnx.TensorProto.FLOAT16}


class VerifyPlan:
    """Extra outputs a verify forward fetches, and how to commit the states from them."""

    strategy = "replay"
    outputs: tuple[str, ...] = ()

    def attach(self, session: ort.InferenceSession, providers: list[str]) -> None:
        """Called once the session over the rewritten graph exists."""

    def commit(
        self, state: DecodeState, snap: Snapshot, fetched: Mapping[str, ort.OrtValue], tokens: int, kept: int
    ) -> bool:
        """Bring ``state`` (just advanced by a verify over ``tokens`` tokens, ``snap`` taken before it) to
        the first ``kept`` of those tokens; False when this plan cannot (the caller replays instead)."""
        raise NotImplementedError


class PerPositionPlan(VerifyPlan):
    """Strategy (b): the verify forward leaves every state after each position in an extra output."""

    strategy = "per-position"

    def __init__(self, per_position: Sequence[PerPosition], io: DecoderIO) -> None:
        by_output = {p.state_output: p for p in per_position}
        self.per_position = [by_output[p.output] for p in io.state_pairs]
        self.outputs = tuple(p.output for p in self.per_position)

    def commit(
        self, state: DecodeState, snap: Snapshot, fetched: Mapping[str, ort.OrtValue], tokens: int, kept: int
    ) -> bool:
        selected = [p.select(fetched[p.output].numpy(), tokens, kept) for p in self.per_position]
        rows = [r for r in selected if r is not None]
        if len(rows) < len(selected):
            return False  # a state window shorter than this verify
        buffers = state.spare_states()
        for buf, row in zip(buffers, rows, strict=True):
            np.copyto(buf.array, row)
        state.commit(state.length - tokens + kept, buffers)
        return True


class CapturePlan(VerifyPlan):
    """Strategy (c): the verify returns the state nodes' per-token inputs; commit re-runs only those nodes."""

    strategy = "capture"

    def __init__(self, captured: CaptureReport, io: DecoderIO, model: onnx.ModelProto) -> None:
        self.captured = captured
        # what the commit graph imports (no graph is kept: the model's opsets and IR version only)
        self.opsets = [(o.domain, o.version) for o in model.opset_import]
        self.ir_version = model.ir_version
        index = {p.input: i for i, p in enumerate(io.state_pairs)}
        self.windows = [(index[w.past], w) for w in captured.windows]
        self.replayed = [
            (index[past], past, present) for r in captured.replays for _, past, present in r.states.values()
        ]
        self.cuts = [
            (name, r.token_axes[slot]) for r in captured.replays for slot, name in r.captures.items()
        ]
        self.outputs = (*(w.capture for w in captured.windows), *(name for name, _ in self.cuts))
        self._session: ort.InferenceSession | None = None
        self.failed = False
        # commit bindings by (kept, fetched buffers): binding, its bound states, the cuts and buffers it
        # points into (held so that no id is reused while the entry lives)
        self._bindings: dict[tuple[int, ...], tuple[ort.IOBinding, dict[str, ort.OrtValue], list, list]] = {}

    def attach(self, session: ort.InferenceSession, providers: list[str]) -> None:
        if not self.captured.replays:
            return
        ports = {
            p.name: (_ELEM_TYPES[p.type], p.shape)
            for p in (*session.get_inputs(), *session.get_outputs())
            if p.type in _ELEM_TYPES
        }
        opts = ort.SessionOptions()
        # one thread: the graph is a few small state updates, and a thread pool of its own would spin
        # after every commit on cores the model's session needs (docs/benchmarks.md)
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            carrier = onnx.ModelProto(ir_version=self.ir_version)
            carrier.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in self.opsets)
            model = commit_graph(self.captured.replays, ports, carrier)
            self._session = ort.InferenceSession(model.SerializeToString(), opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types
            log.warning("the state-commit graph cannot be loaded (%s); verifies will replay instead", e)
            self.outputs = ()
            self.failed = True

    def _commit_binding(
        self, fetched: Mapping[str, ort.OrtValue], kept: int
    ) -> tuple[ort.IOBinding, dict[str, ort.OrtValue], list[np.ndarray]]:
        """The commit graph's binding with the captured inputs cut to ``kept`` tokens bound, and what it
        has bound otherwise (by name). Cuts that are views of the fetched buffers (batch 1) are bound by
        pointer once: verify forwards reuse their fetched buffers, so the binding is cached per buffers
        and ``kept``; cuts that had to be copied are bound afresh."""
        key = (kept, *(id(fetched[name]) for name, _ in self.cuts))
        cached = self._bindings.get(key)
        if cached is not None:
            return cached[0], cached[1], cached[2]
        assert self._session is not None
        binding = self._session.io_binding()
        cuts, views = [], True  # bound by pointer: kept alive with the binding
        for name, axis in self.cuts:
            whole = fetched[name].numpy()  # shares the OrtValue's memory on the CPU
            cut = np.ascontiguousarray(cut_tokens(whole, axis, kept))
            views = views and np.shares_memory(cut, whole)
            cuts.append(cut)
            binding.bind_input(name, "cpu", 0, cut.dtype, cut.shape, cut.ctypes.data)
        bound: dict[str, ort.OrtValue] = {}
        if views:
            if len(self._bindings) >= 64:
                self._bindings.clear()
            self._bindings[key] = (binding, bound, cuts, [fetched[n] for n, _ in self.cuts])
        return binding, bound, cuts  # the caller keeps the cuts alive until the run is over

    def commit(
        self, state: DecodeState, snap: Snapshot, fetched: Mapping[str, ort.OrtValue], tokens: int, kept: int
    ) -> bool:
        if self.failed:
            return False
        buffers = state.spare_states()
        if self._session is not None:
            binding, bound, _cuts = self._commit_binding(fetched, kept)
            for i, past, present in self.replayed:
                for name, value, bind in (
                    (past, snap.states[i].value, binding.bind_ortvalue_input),
                    (present, buffers[i].value, binding.bind_ortvalue_output),
                ):
                    if bound.get(name) is not value:
                        bind(name, value)
                        bound[name] = value
            try:
                self._session.run_with_iobinding(binding)
            except Exception as e:  # the state is untouched: the caller replays instead
                log.warning("the state-commit graph failed (%s); replaying the kept tokens instead", e)
                return False
        for i, w in self.windows:
            conv_state_after(snap.states[i].array, fetched[w.capture].numpy(), kept, w.axis, buffers[i].array)
        state.commit(state.length - tokens + kept, buffers)
        return True


VERIFY_STRATEGIES = ("auto", "capture", "per-position", "replay")


def verify_strategy(verify: bool | str, io: DecoderIO) -> tuple[str | None, str]:
    """The verify plan's strategy to make at the first speculative verify (None: verifies replay), and why.

    ``verify`` is True ("auto"), a strategy, or False ("replay"). Whether the strategy covers every state is
    known once its graph is made (:func:`plan_graph`), which a session does when speculation first needs it:
    the rewritten graph's extra outputs cost every plain step too."""
    if not verify or verify == "replay":
        return None, "the replay strategy was asked for"
    if not io.state_pairs:
        return None, "the model has no recurrent state"
    strategy = "auto" if verify is True else str(verify)
    if strategy not in VERIFY_STRATEGIES:
        raise ValueError(f"verify strategy {strategy!r} is not one of {', '.join(VERIFY_STRATEGIES)}")
    return strategy, f"verify={strategy!r}: its graph is made at the first speculative verify"


def plan_graph(
    model: onnx.ModelProto, io: DecoderIO, providers: Sequence[str], strategy: str = "auto"
) -> tuple[onnx.ModelProto, VerifyPlan | None, str]:
    """The graph rewritten for the verify plan of ``strategy`` and that plan; or ``model``, None and why
    not (dense models, ``"replay"``, state nodes the passes do not know).

    ``"auto"``: the CUDA state window where the session runs on CUDA and it covers every state, else
    capture. ``"per-position"``: per-position outputs (Scan exports; fused exports on CUDA) or nothing.
    """
    if strategy not in VERIFY_STRATEGIES:
        raise ValueError(f"verify strategy {strategy!r} is not one of {', '.join(VERIFY_STRATEGIES)}")
    if not io.state_pairs:
        return model, None, "the model has no recurrent state"
    if strategy == "replay":
        return model, None, "the replay strategy was asked for"
    pairs = [(p.input, p.output) for p in io.state_pairs]
    outputs = [p.output for p in io.state_pairs]
    reasons: dict[str, str] = {}
    cuda = "CUDAExecutionProvider" in providers
    if strategy == "per-position" or (strategy == "auto" and cuda):
        passes = [emit_fused_state_window] if cuda else []
        for rewrite in [*passes, emit_scan_states] if strategy == "per-position" else passes:
            done = rewrite(model, pairs)
            per = done.report
            if per.covers(outputs):
                return done.model, PerPositionPlan(per.per_position, io), ""
            reasons.update(per.skipped)
    if strategy in ("auto", "capture"):
        captured = capture_state_inputs(model, pairs)
        cap = captured.report
        if cap.covers(outputs):
            return captured.model, CapturePlan(cap, io, model), ""
        reasons.update(cap.skipped)
    why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    return model, None, f"no {strategy} verify plan covers every state ({why})"
