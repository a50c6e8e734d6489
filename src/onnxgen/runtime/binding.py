"""IO-binding caches, and the one place onnxgen reaches below onnxruntime's documented Python API.

A forward binds its inputs and outputs through an ``onnxruntime.IOBinding``. Rebinding what is already
bound costs a call into onnxruntime per port, so every state keeps its bindings between forwards:

- :class:`Binder`: one IOBinding and what is bound to it (a port bound to the same OrtValue as last time
  is not bound again), with the persistent input, logits and fetched-output buffers of small forwards;
- :class:`StateBindings`: the binders of one decode or batch state, by (session, slot), plus the state's
  prepared single-token steps (:class:`StepLane`) and the attention mask those keep bound
  (:class:`LengthMask`);
- :class:`OnesMasks`: a session's attention masks of ones, one OrtValue per shape;
- :class:`OrtInternals`: onnxruntime's private attributes that the single-token lane (and a session's
  creation, int4 quantization) use, named in
  :attr:`OrtInternals.ATTRIBUTES` and read in one method, so that a release renaming one of them shows
  up in one place (tests/runtime/test_binding.py fails naming it) and the engine falls back to the
  documented API with a warning rather than breaking.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from onnxgen.errors import OnnxgenError
from onnxgen.runtime.buffers import HostBuffer, aligned_empty, aligned_zeros

if TYPE_CHECKING:
    import onnxruntime.capi.onnxruntime_pybind11_state as C

    from onnxgen.runtime.state import StepIO

log = logging.getLogger(__name__)

MASK_VALUES = 8192  # attention-mask OrtValues kept per session, one per (batch, length)


class Binder:
    """One IOBinding plus what is bound to it, so unchanged KV/state buffers are not bound again.

    A decode state alternates between two state buffers (ping-pong), so each state keeps two binders
    (by step parity) and in steady state no KV or state port is rebound at all.
    """

    def __init__(self, binding: ort.IOBinding) -> None:
        self.binding = binding
        self._inputs: dict[str, ort.OrtValue] = {}
        self._outputs: dict[str, ort.OrtValue | None] = {}
        self.allocates = False
        # Logits output buffers by (batch, rows): per binder, hence per state, so that forwards of
        # different states on other threads never write into the logits one is still copying out.
        self.logits: dict[tuple[int, int], HostBuffer] = {}
        # Token/position/logits-to-keep inputs of small forwards by (name, shape): written in place and
        # bound once, so a steady run of single-token steps binds none of them again.
        self.step_inputs: dict[tuple[str, tuple[int, ...]], HostBuffer] = {}
        self.single: dict[int, SingleInputs] = {}  # by batch: the one-token forward's inputs
        # Extra outputs of verify forwards (one binder per token count), bound from their second run on.
        self.fetch_buffers: dict[str, HostBuffer] = {}
        # once all of them are bound: the fetch list they serve and their values by name
        self.fetch_bound: tuple[Sequence[str], dict[str, ort.OrtValue]] | None = None
        # The KV/state bindings last made through this binder (a StepIO's lists): equal lists are bound
        self.state_inputs: list[tuple[str, ort.OrtValue]] = []
        self.state_outputs: list[tuple[str, ort.OrtValue | None]] = []
        self.touched = 0  # forwards through this binder (a lane made after one is valid until the next)

    def input(self, name: str, value: ort.OrtValue) -> None:
        if self._inputs.get(name) is not value:
            self.binding.bind_ortvalue_input(name, value)
            self._inputs[name] = value

    def output(self, name: str, value: ort.OrtValue | None) -> None:
        """Bind ``value``, or let onnxruntime allocate the output (``None``; rebound every run)."""
        if value is None:
            self.binding.bind_output(name, "cpu")
            if self._outputs.get(name, self) is not None:  # new, or was a buffer
                self._outputs[name] = None
                self.allocates = True
        else:
            old = self._outputs.get(name, self)
            if old is not value:
                self.binding.bind_ortvalue_output(name, value)
                self._outputs[name] = value
                if old is None:  # one allocated output fewer
                    self.allocates = any(v is None for v in self._outputs.values())

    def record_input(self, name: str, value: ort.OrtValue) -> None:
        """Note that ``value`` was bound to ``name`` past :meth:`input` (a lane binds it directly)."""
        self._inputs[name] = value

    def bound_input(self, name: str) -> ort.OrtValue | None:
        return self._inputs.get(name)

    def step_input(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """The persistent input buffer ``(name, shape)``, bound; the caller writes its values in place."""
        buf = self.step_inputs.get((name, shape))
        if buf is None:
            buf = self.step_inputs[(name, shape)] = HostBuffer.wrap(aligned_zeros(shape, dtype))
        self.input(name, buf.value)
        return buf.array

    def allocated_outputs(self) -> dict[str, ort.OrtValue]:
        """The outputs onnxruntime allocated in the last run, by name (binding order is output order)."""
        values = self.binding.get_outputs()
        names = list(self._outputs)
        return {n: v for n, v in zip(names, values, strict=True) if self._outputs[n] is None}


@dataclass
class SingleInputs:
    """A binder's bound token / position / logits-to-keep buffers of one-token forwards."""

    tokens: np.ndarray
    positions: np.ndarray | None
    keep: np.ndarray | None  # logits-to-keep: shared with longer forwards of the binder, so written each step
    token_input: str
    token_value: ort.OrtValue

    def bound(self, binder: Binder) -> bool:
        """Whether the binder still has these buffers bound: a longer forward rebinds the token input
        (another shape) whenever it rebinds the others, so that one is checked."""
        return binder.bound_input(self.token_input) is self.token_value


class LengthMask:
    """A decode state's ``[1, capacity]`` attention mask that its lanes keep bound (graphs whose mask only
    gives GroupQueryAttention its lengths, :mod:`onnxgen.graph.mask_lengths`): ones over the first
    ``filled`` positions, zeros after. Both lanes of the state share it; a step at position ``past``
    writes one element, or (after a rewind, or steps that ran without a lane) re-fills it first."""

    def __init__(self, capacity: int, dtype: np.dtype | type) -> None:
        self.buffer = HostBuffer.wrap(aligned_zeros((1, capacity), dtype))
        self.row = self.buffer.array[0]
        self.filled = 0

    def fill(self, length: int) -> None:
        self.row[:length] = 1
        self.row[length:] = 0
        self.filled = length


class OnesMasks:
    """``[batch, length]`` attention masks of ones as OrtValues, each a view of one read-only buffer, made
    once per shape: binding a kept OrtValue is much cheaper than making one from numpy at every step of a
    decode loop. At most ``MASK_VALUES`` shapes are kept (then they are made again)."""

    def __init__(self, dtype: np.dtype | type) -> None:
        self.dtype = dtype
        self.buffer = np.ones(0, dtype=dtype)
        self.values: dict[tuple[int, int], ort.OrtValue] = {}

    def get(self, batch: int, length: int) -> ort.OrtValue:
        value = self.values.get((batch, length))
        if value is not None:
            return value
        n = batch * length
        if self.buffer.size < n:
            self.buffer = aligned_empty((max(n, 2 * self.buffer.size),), self.dtype)
            self.buffer.fill(1)
            self.buffer.flags.writeable = False
        if len(self.values) >= MASK_VALUES:
            self.values.clear()
        value = self.values[(batch, length)] = ort.OrtValue.ortvalue_from_numpy(
            self.buffer[:n].reshape(batch, length)
        )
        return value


@dataclass(frozen=True)
class RawBinding:
    """onnxruntime's own objects behind a session and one of its IOBindings (:meth:`OrtInternals.raw`).
    Their Python wrappers re-check on every call what a lane checked once when it was made."""

    run: Callable[[C.SessionIOBinding, C.RunOptions], None]  # the session's run_with_iobinding
    binding: C.SessionIOBinding  # the IOBinding, as ``run`` takes it
    bind_input: Callable[[str, ort.OrtValue], None]  # bind a (wrapped) OrtValue to an input of ``binding``


@dataclass(eq=False)
class StepLane:
    """A prepared steady decode step of a batch-1 state (``DecoderSession.step``): one binder of the
    steady cycle with everything bound but the attention mask, run through onnxruntime's own binding
    objects (a :class:`RawBinding`'s, kept flat: the step reads them every token). Valid while the state's next step is ``cycle`` and no other forward
    went through ``binder`` (the forward that made it is the binder's ``touched``-th)."""

    session: ort.InferenceSession
    binder: Binder
    touched: int
    cycle: StepIO
    run: Callable[[C.SessionIOBinding, C.RunOptions], None]  # RawBinding.run
    binding: C.SessionIOBinding  # RawBinding.binding
    bind_input: Callable[[str, ort.OrtValue], None]  # RawBinding.bind_input
    tokens: np.ndarray  # the bound [1, 1] token buffer
    positions: np.ndarray | None  # the bound position buffer ([1, 1] or [3, 1, 1])
    logits: np.ndarray  # [vocab]: the bound logits buffer's row
    mask: LengthMask | None  # the state's bound capacity-long mask, else a mask is bound per step
    fetch: Sequence[str] = ()  # extra outputs the lane's binder has bound to persistent buffers ...
    fetched: Mapping[str, ort.OrtValue] | None = None  # ... and those buffers by name


class StateBindings:
    """The IO bindings one state (a :class:`~onnxgen.runtime.state.DecodeState`, a batch) keeps between
    forwards: binders by (onnxruntime session, slot), made for one ``DecoderSession.epoch`` (a replaced
    session's binders hold it alive, so they go with it), the lanes of the two step parities and their
    bound mask. The session that runs the state fills them; the state drops them when what they bind
    goes away (:meth:`clear`, :meth:`drop`)."""

    def __init__(self) -> None:
        self.binders: dict[tuple[ort.InferenceSession, int], Binder] = {}
        self.epoch = 0  # the DecoderSession.epoch the binders were made for
        # Per step parity: a session's prepared steady step over the state (DecoderSession.step), valid
        # while the next step's StepIO is the very one it binds (DecodeState.take_cycle).
        self.lanes: list[StepLane | None] = [None, None]
        self.lane_mask: LengthMask | None = None  # the lanes' bound mask, where the session keeps one

    def binder(self, session: ort.InferenceSession, slot: int, epoch: int = 0) -> Binder:
        """The binder of ``(session, slot)``, made on first use; all are dropped first when ``epoch``
        differs from theirs."""
        if epoch != self.epoch:
            self.binders.clear()
            self.epoch = epoch
        binder = self.binders.get((session, slot))
        if binder is None:
            binder = self.binders[(session, slot)] = Binder(session.io_binding())
        return binder

    def clear(self) -> None:
        """Forget the binders (what they bind is about to change or go); lanes check their binder."""
        self.binders.clear()

    def drop(self) -> None:
        """Forget binders and lanes (their session is being replaced)."""
        self.binders.clear()
        self.lanes = [None, None]


@dataclass(frozen=True)
class PrivateAttribute:
    """One onnxruntime name outside its documented API that onnxgen uses, and why."""

    owner: str  # the object or module that has it
    path: str  # the attribute, dotted through the objects it leads to
    why: str


class OrtInternals:
    """Every use onnxgen makes of onnxruntime's private or undocumented attributes.

    The documented wrappers (``InferenceSession.run_with_iobinding``, ``IOBinding.bind_ortvalue_input``)
    check their arguments and unwrap them on every call; for a single-token decode step that is a
    measurable share of the step, so a prepared lane calls the C objects below them directly. Exporting an
    MTP head, and a drafter's int4 lm_head, quantize weights with the C function behind onnxruntime's
    MatMulNBits quantizer. A load makes its session in the wrapper's two C calls (:meth:`session`), so
    that the tokenizer is parsed while onnxruntime initializes the session. Nothing
    else in onnxgen touches a private name of onnxruntime: the names are listed in :attr:`ATTRIBUTES`
    (tests/runtime/test_binding.py checks each on the installed onnxruntime) and read only here."""

    ATTRIBUTES = (
        PrivateAttribute(
            "onnxruntime.InferenceSession",
            "_sess.run_with_iobinding",
            "the C session's run over an IOBinding, below the wrapper's per-call checks",
        ),
        PrivateAttribute(
            "onnxruntime.IOBinding",
            "_iobinding.bind_ortvalue_input",
            "the C IOBinding the C run takes, and its bind of an unwrapped OrtValue",
        ),
        PrivateAttribute(
            "onnxruntime.OrtValue", "_ortvalue", "the C OrtValue a wrapped one holds (what the C bind takes)"
        ),
        PrivateAttribute(
            "onnxruntime.capi._pybind_state",
            "quantize_matmul_4bits",
            "blockwise int4 quantization as MatMulNBits stores it (exporting an MTP head; a drafter's int4 lm_head)",
        ),
        PrivateAttribute(
            "onnxruntime.capi._pybind_state",
            "InferenceSession.initialize_session",
            "a session made in the wrapper's two C calls, so that a load can act between them (session())",
        ),
        PrivateAttribute(
            "onnxruntime.InferenceSession",
            "_from_initialized_c_session",
            "the documented wrapper around a C session made that way",
        ),
    )
    _warned = False

    @classmethod
    def raw(
        cls, session: ort.InferenceSession, binding: ort.IOBinding, value: ort.OrtValue
    ) -> RawBinding | None:
        """The C objects behind ``session`` and ``binding``, or None (logged once) where this onnxruntime
        does not have them; ``value`` is any OrtValue, checked for its C object."""
        run = getattr(getattr(session, "_sess", None), "run_with_iobinding", None)
        raw = getattr(binding, "_iobinding", None)
        bind = getattr(raw, "bind_ortvalue_input", None)
        if run is None or raw is None or bind is None or not hasattr(value, "_ortvalue"):
            if not cls._warned:
                cls._warned = True
                log.warning(
                    "onnxruntime %s lacks the binding internals onnxgen's decode lane uses (%s); "
                    "single-token steps run through the documented API, a little slower",
                    ort.__version__,
                    ", ".join(cls.missing(session, binding, value)),
                )
            return None

        def bind_input(name: str, v: ort.OrtValue) -> None:
            bind(name, v._ortvalue)

        return RawBinding(run=run, binding=raw, bind_input=bind_input)

    @classmethod
    def quantize_matmul_4bits(cls) -> Callable[..., None]:
        """onnxruntime's ``quantize_matmul_4bits(packed, weights, scales, zero_points, block, n, k,
        symmetric)``, which fills ``packed`` / ``scales`` / ``zero_points`` as MatMulNBits reads them."""
        module = importlib.import_module("onnxruntime.capi._pybind_state")
        fn = getattr(module, "quantize_matmul_4bits", None)
        if fn is None:
            raise OnnxgenError(
                f"onnxruntime {ort.__version__} has no onnxruntime.capi._pybind_state.quantize_matmul_4bits, "
                "which int4 quantization (exporting an MTP head, a drafter's int4 lm_head) uses; install an "
                "onnxruntime that has it"
            )
        return fn

    @classmethod
    def session(
        cls,
        source: str | bytes,
        options: ort.SessionOptions,
        providers: Sequence[str],
        before_initialize: Callable[[], None],
    ) -> ort.InferenceSession:
        """``ort.InferenceSession(source, options, providers=providers)``, calling ``before_initialize``
        between the two C calls the wrapper makes: reading the model, then initializing the session (graph
        optimizations and weight prepacking, most of a load, with the GIL released). A thread that holds
        the GIL for a while (the tokenizers library parsing ``tokenizer.json``) can then run entirely
        inside the second call instead of holding up the caller's Python. CPU provider only; for other
        providers, or where this onnxruntime lacks the internals, ``before_initialize`` is called first
        and the wrapper makes the session. Unlike the wrapper's, such a session does not retry a failed
        creation on the CPU provider (it is on the CPU already) and cannot be re-created in place
        (``set_providers``; onnxgen makes a new session instead)."""
        module = importlib.import_module("onnxruntime.capi._pybind_state")
        make = getattr(module, "InferenceSession", None)
        wrap = getattr(ort.InferenceSession, "_from_initialized_c_session", None)
        if list(providers) != ["CPUExecutionProvider"] or make is None or wrap is None:
            before_initialize()
            return ort.InferenceSession(source, sess_options=options, providers=providers)
        # the wrapper's arguments for the CPU provider alone (no provider options, no disabled optimizer)
        from_config = os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1"
        session = make(options, source, isinstance(source, str), from_config)
        before_initialize()
        session.initialize_session(["CPUExecutionProvider"], [{}], set())
        return wrap(session)

    @classmethod
    def missing(cls, session: ort.InferenceSession, binding: ort.IOBinding, value: ort.OrtValue) -> list[str]:
        """The :attr:`ATTRIBUTES` the installed onnxruntime lacks, as ``owner.path`` (empty: all there)."""
        roots: dict[str, Any] = {
            "onnxruntime.InferenceSession": session,
            "onnxruntime.IOBinding": binding,
            "onnxruntime.OrtValue": value,
        }
        out = []
        for attr in cls.ATTRIBUTES:
            if attr.owner in roots:
                obj = roots[attr.owner]
            else:
                try:
                    obj = importlib.import_module(attr.owner)
                except ImportError:
                    out.append(f"{attr.owner} (module)")
                    continue
            for part in attr.path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    out.append(f"{attr.owner}.{attr.path}")
                    break
        return out
