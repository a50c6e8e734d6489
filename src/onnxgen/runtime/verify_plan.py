"""Verify plans: commit a hybrid model's recurrent states to an accepted draft prefix without a replay.

After a speculative verify forward over T tokens (the pending token and T-1 drafts) accepts only some
drafts, the model must hold exactly the first ``kept`` tokens. KV caches are rewound by length; recurrent
states cannot be (REFERENCE.md section 4). The universal answer, strategy (a), restores the states saved
before the verify and replays the kept tokens: a second forward. A verify plan avoids that forward:

- :class:`PerPositionPlan`, strategy (b): the graph emits each state after every position (Scan exports:
  :mod:`onnxgen.graph.scan_state_window`; fused exports on CUDA: :mod:`onnxgen.graph.fused_state_window`);
  commit copies the kept position's state into a fresh state buffer, one copy per state.
- :class:`CapturePlan`, strategy (c): the graph exports the fused state ops' per-token inputs
  (:mod:`onnxgen.graph.fused_state_capture`); commit runs a small weightless graph that re-applies only the
  state ops to the kept tokens, starting from the states saved before the verify.

The rewritten graph only gains outputs, so one session serves every forward: ordinary forwards do not
fetch the extra outputs, verify forwards do (:meth:`DecoderSession.forward_capture`). Plans bind the same
state buffers by the same port names as every other forward, so state continuity is by name as always.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from onnxgen.errors import UnsupportedModelError
from onnxgen.graph.fused_state_capture import (
    CapturedOp,
    capture_fused_inputs,
    commit_graph,
    conv_state_after,
)
from onnxgen.graph.fused_state_window import emit_fused_state_window
from onnxgen.graph.scan_state_window import emit_scan_states
from onnxgen.graph.state_window import PerPosition, default_opset
from onnxgen.model.io import DecoderIO
from onnxgen.runtime.state import DecodeState, Snapshot

log = logging.getLogger(__name__)

_ELEM_TYPES = {"tensor(float)": onnx.TensorProto.FLOAT, "tensor(float16)": onnx.TensorProto.FLOAT16}


class VerifyPlan:
    """Extra outputs a verify forward fetches, and how to commit the states from them."""

    strategy = "replay"
    outputs: tuple[str, ...] = ()

    def attach(
        self, session: ort.InferenceSession, options: ort.SessionOptions, providers: list[str]
    ) -> None:
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
        rows = [p.select(fetched[p.output].numpy(), tokens, kept) for p in self.per_position]
        if any(r is None for r in rows):
            return False  # a state window shorter than this verify
        buffers = state.spare_states()
        for buf, row in zip(buffers, rows, strict=True):
            np.copyto(buf.array, row)
        state.commit(state.length - tokens + kept, buffers)
        return True


class CapturePlan(VerifyPlan):
    """Strategy (c): the verify exports the fused state ops' inputs; commit replays only those ops."""

    strategy = "capture"

    def __init__(self, captured: Sequence[CapturedOp], io: DecoderIO, opset: int) -> None:
        by_output = {c.state_output: c for c in captured}
        self.captured = [by_output[p.output] for p in io.state_pairs]
        self.outputs = tuple(name for c in self.captured for name in c.captures.values())
        self.opset = opset
        self._session: ort.InferenceSession | None = None

    def attach(
        self, session: ort.InferenceSession, options: ort.SessionOptions, providers: list[str]
    ) -> None:
        if not any(c.op_type == "LinearAttention" for c in self.captured):
            return
        ports = {}
        for p in (*session.get_inputs(), *session.get_outputs()):
            if p.type in _ELEM_TYPES:
                ports[p.name] = (_ELEM_TYPES[p.type], p.shape)
        model = commit_graph(self.captured, ports, self.opset)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = options.intra_op_num_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(model.SerializeToString(), opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types
            raise UnsupportedModelError(
                f"onnxruntime could not load the state-commit graph of the fused linear layers: {e}"
            ) from e

    def commit(
        self, state: DecodeState, snap: Snapshot, fetched: Mapping[str, ort.OrtValue], tokens: int, kept: int
    ) -> bool:
        buffers = state.spare_states()
        binding = self._session.io_binding() if self._session is not None else None
        keep_alive: list[np.ndarray] = []  # the captures bound by pointer, until the run is over
        for op, past, out in zip(self.captured, snap.states, buffers, strict=True):
            if op.op_type == "CausalConvWithState":
                x = fetched[op.captures[0]].numpy()
                conv_state_after(past.array, x, kept, op.seq_axis, out.array)
                continue
            assert binding is not None  # attach() made the commit session: there is a LinearAttention
            binding.bind_ortvalue_input(op.state_input, past.value)
            for name in op.captures.values():
                cut = np.ascontiguousarray(fetched[name].numpy()[:, :kept])  # a view when batch is 1
                keep_alive.append(cut)
                binding.bind_input(name, "cpu", 0, cut.dtype, cut.shape, cut.ctypes.data)
            binding.bind_ortvalue_output(op.state_output, out.value)
        if binding is not None:
            try:
                self._session.run_with_iobinding(binding)  # type: ignore[union-attr]
            except Exception as e:  # the state is untouched: the caller replays instead
                log.warning("the state-commit graph failed (%s); replaying the kept tokens instead", e)
                return False
        state.commit(state.length - tokens + kept, buffers)
        return True


def plan_graph(
    model: onnx.ModelProto, io: DecoderIO, providers: Sequence[str]
) -> tuple[onnx.ModelProto, VerifyPlan | None, str]:
    """The graph rewritten for the verify plan that fits ``model``, and that plan; or ``model``, None and
    why no plan fits (dense models, state ops the passes do not know)."""
    if not io.state_pairs:
        return model, None, "the model has no recurrent state"
    pairs = [(p.input, p.output) for p in io.state_pairs]
    outputs = [p.output for p in io.state_pairs]
    rewritten, per = emit_scan_states(model, pairs)
    if per.covers(outputs):
        return rewritten, PerPositionPlan(per.per_position, io), ""
    if "CUDAExecutionProvider" in providers:
        rewritten, per = emit_fused_state_window(model, pairs)
        if per.covers(outputs):
            return rewritten, PerPositionPlan(per.per_position, io), ""
    rewritten, cap = capture_fused_inputs(model, pairs)
    if cap.covers(outputs):
        return rewritten, CapturePlan(cap.captured, io, default_opset(model)), ""
    reasons = {**per.skipped, **cap.skipped}
    why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    return model, None, f"no per-position state output fits every state ({why})"
