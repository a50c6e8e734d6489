"""DecoderSession: an onnxruntime session driven through IO binding.

One forward binds the step's small inputs (token ids, attention mask, position ids), the KV and
recurrent-state buffers of a :class:`DecodeState` (by port name), and the logits output, runs, and
advances the state. Nothing on that path copies a KV cache or a recurrent state.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from onnxgen.config import default_threads
from onnxgen.errors import GenerationError, UnsupportedModelError
from onnxgen.graph.logits_to_keep import LOGITS_TO_KEEP
from onnxgen.graph.serial_attention import SerialAttention, serialize_attention
from onnxgen.runtime import hugepages, memory
from onnxgen.runtime.binding import Binder, LengthMask, OnesMasks, OrtInternals, SingleInputs, StepLane
from onnxgen.runtime.buffers import HostBuffer, IndexDtypes, aligned_empty
from onnxgen.runtime.graph_cache import SessionGraph
from onnxgen.runtime.observer import ForwardEvent, ForwardObserver, Phase, phase_of
from onnxgen.runtime.state import DecodeState, StepIO
from onnxgen.runtime.state_commit import VerifyPlan, plan_graph, verify_strategy

if TYPE_CHECKING:
    from onnxgen.runtime.decode_routing import DecodePlan

# onnxruntime's session option naming the folder external weights are read from
FOLDER_KEY = "session.model_external_initializers_file_folder_path"

log = logging.getLogger(__name__)


class BindingOwner(Protocol):
    """Something that keeps IO bindings of a session (a decode state, a batch)."""

    def drop_bindings(self) -> None: ...


LANE_DECAY = 0.8  # weight of the past in the moving average of lane steps' time
SERIAL_KIND = 1 << 20  # binder slots of serial-attention verifies (:meth:`DecoderSession.serialize_verifies`)
SMALL_STEP = 16  # forwards of at most this many tokens bind persistent buffers (inputs, fetched outputs)


def make_session_options(threads: int | None, spinning: bool | None = None) -> ort.SessionOptions:
    """Options of a decoder session: ``threads`` intra-op threads (None: one per core), which sleep
    between parallel sections where ``spinning`` is False (None, True: onnxruntime's spinning)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or default_threads()
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if spinning is False:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def _nothing() -> None:
    pass


def _run_failed(tokens: int, past: int, error: Exception) -> GenerationError:
    return GenerationError(f"forward over {tokens} tokens at position {past} failed: {error}")


class DecoderSession:
    """Runs forwards of one decoder export over a :class:`DecodeState`, on the graph prepared for it
    (:func:`onnxgen.runtime.graph_cache.session_graph`, or :func:`onnxgen.prepare.prepare` for a model):
    the session rewrites no graph but the verify plan's, made when speculation first asks for it."""

    def __init__(
        self,
        prepared: SessionGraph,
        *,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        options: ort.SessionOptions | None = None,
        verify: bool | str = True,
        huge_pages: bool | None = None,
        inplace: bool | None = None,
        verify_now: bool = False,
        spinning: bool | None = None,
        before_initialize: Callable[[], None] | None = None,
    ) -> None:
        """``before_initialize``: called once onnxruntime has read the graph, just before it initializes
        the session (optimizes the graph, packs the weights; the GIL is released meanwhile), or before the
        session is made where that moment cannot be told apart (:meth:`OrtInternals.session`)."""
        self.io = io = prepared.io
        providers = list(providers or ["CPUExecutionProvider"])
        on_cpu = providers[0] == "CPUExecutionProvider"
        if on_cpu != prepared.settings.on_cpu:
            raise ValueError(
                f"the graph was prepared for {'the CPU' if prepared.settings.on_cpu else 'another'} provider "
                f"but the session runs on {providers[0]}: prepare it with the session's providers"
            )
        # back the weights with transparent huge pages (onnxgen.runtime.hugepages); host memory only
        self._huge_pages = huge_pages is not False and on_cpu
        self.threads = threads or default_threads()
        self._model_path = prepared.model_path
        self._options = options or make_session_options(self.threads, spinning)
        self._providers = providers
        self.prepared = prepared
        # ``hidden_state``: the graph also outputs the final hidden state (what an MTP head drafts from)
        self.hidden_state: str | None = prepared.hidden_state
        self.logits_to_keep = prepared.logits_to_keep
        self.fast_ops = prepared.fast_ops
        self.fusions = prepared.fusions
        # recurrent states (by input name) that steady decoding updates in place (DecodeState's cycle,
        # BatchState); onnxruntime's CPU kernels only, where the ops' reads were checked (tests compare
        # against double buffering)
        allow_inplace = inplace is None or inplace
        self.inplace_states = self.prepared.inplace_states if allow_inplace else frozenset()
        # lanes of graphs whose mask only gives GroupQueryAttention its lengths keep one capacity-long
        # mask bound and write one element per step (onnxgen.graph.mask_lengths; CPU kernel checked)
        self.length_mask = self.prepared.length_mask
        self._verify_plan: VerifyPlan | None = None
        self._verify_strategy = verify_strategy(verify, io)[0]  # a plan not yet made (None: replay)
        self._plan_strategy = self._verify_strategy  # what the verify plan is (or will be) made with
        self._verify_lock = threading.Lock()
        # verifies of exactly ``serial_width`` tokens run each attention position as its own call
        # (:meth:`serialize_verifies`); present output -> the per-position outputs bound beside it
        self.serial_width: int | None = None
        self._serial_aliases: dict[str, list[str]] = {}
        # bindings made on this session (decode and batch states): dropped when the session is replaced
        self._binding_owners: weakref.WeakSet[BindingOwner] = weakref.WeakSet()
        self._open_session(verify_now, before_initialize)
        self.epoch = 0  # bumped when the session is replaced; decode states drop bindings of older ones
        self.plan: DecodePlan | None = None  # routes single-token steps (onnxgen.runtime.decode_routing)
        self._set_up_binding()

    def _open_session(self, verify_now: bool, before_initialize: Callable[[], None] | None) -> None:
        """Create the onnxruntime session on the prepared graph, or on the verify plan's with
        ``verify_now`` (the caller will speculate: load the plan's graph now rather than plain first and
        again at the first verify, a second session load)."""
        source, folder = self.prepared.source()
        # graphs loaded from bytes (the prepared graph, the verify plan's) resolve their weights here
        self._options.add_session_config_entry(FOLDER_KEY, str(folder or self._model_path.parent))
        eager = self._verify_graph() if verify_now and self._verify_strategy is not None else None
        if verify_now:
            self._verify_strategy = None
        source = eager[0] if eager is not None else source
        self.session: ort.InferenceSession = self._load(source, before_initialize)
        if eager is not None:
            eager[1].attach(self.session, self._providers)
            self._verify_plan = eager[1]

    def _set_up_binding(self) -> None:
        """What forwards bind, read once from the session's graph: the vocabulary, element types, the
        attention-mask buffers and the run options."""
        io = self.io
        self.vocab_size = self._vocab_size()
        self._vocab_limit = self.vocab_size if self.vocab_size > 0 else sys.maxsize  # ids checked below it
        self._logits_dtype = self._output_dtype(io.logits)
        self._shared_kv = io.kv_in_place
        # every input onnxgen writes takes the element type the graph declares (int64 or int32, checked
        # when the I/O was derived)
        self._dtypes = IndexDtypes.of(io)
        self._ones = OnesMasks(self._dtypes.mask).get  # attention masks of ones, one OrtValue per shape
        self._run_options = ort.RunOptions()  # what the wrapper's run_with_iobinding passes by default
        # After a forward over many tokens (a prefill) onnxruntime's arena holds its activations: tens to
        # hundreds of MB at real sizes, kept (and grown by later prefills) for the life of the session.
        # The next single-token step runs with the arena's shrinkage on, which hands the regions no longer
        # in use back; prefill chunks in a row keep theirs.
        self._shrink_options = ort.RunOptions()
        self._shrink_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._shrink_pending = False
        self.lane_steps = 0  # single-token steps that ran on a prepared lane (:meth:`step`) ...
        # ... and a moving average of their seconds: what a plain decode step costs (None before one ran);
        # speculation's ``auto`` compares verifies with it
        self.lane_step_s: float | None = None
        # called after every forward with its phase, shape and time (onnxgen.runtime.observer); None: off
        self.forward_observer: ForwardObserver | None = None

    def _load(
        self, source: str | bytes, before_initialize: Callable[[], None] | None = None
    ) -> ort.InferenceSession:
        try:
            with hugepages.collapsing(self._huge_pages):
                session = OrtInternals.session(
                    source, self._options, self._providers, before_initialize or _nothing
                )
        except Exception as e:  # onnxruntime raises its own exception types
            raise UnsupportedModelError(
                f"onnxruntime could not load {self._model_path}: {e}. Check that the installed onnxruntime "
                "supports every op of the export (see `onnxgen inspect`)"
            ) from e
        # the weight pages loading read are kept packed on onnxruntime's heap: the mapped ones can go
        memory.release_file_pages(self.weight_folders)
        return session

    @property
    def weight_folders(self) -> list[Path]:
        """The folders of the files the session's weights are mapped from (the export's, the cache's)."""
        folders = [self._model_path.parent]
        if self.prepared.graph_path is not None:
            folders.append(self.prepared.graph_path.parent)
        return folders

    @property
    def verify_plan(self) -> VerifyPlan | None:
        """How speculative verifies commit recurrent states without a replay (None: by replay). The first
        read moves the session onto the plan's graph: the plain session is released, then the plan's is
        made (decode states keep their buffers and bind them again by name)."""
        if self._verify_strategy is not None:
            with self._verify_lock:
                if self._verify_strategy is not None:
                    self._switch_to_verify_plan()
        return self._verify_plan

    @verify_plan.setter
    def verify_plan(self, plan: VerifyPlan | None) -> None:
        """Use ``plan`` (None: commit by replay) from now on, on the session as it is."""
        with self._verify_lock:
            self._pending = None
            self._verify_plan = plan

    def _verify_graph(self) -> tuple[bytes, VerifyPlan] | None:
        """The prepared graph rewritten for the verify plan (serialized, weights by reference) and the plan;
        None (and why, logged) where no plan covers the model's states."""
        assert self._verify_strategy is not None
        self.prepared = self.prepared.still_on_disk()
        graph = self.prepared.load_graph()
        rewritten, plan, why = plan_graph(graph, self.io, self._providers, self._verify_strategy)
        if plan is None:
            log.info("speculative verify will commit recurrent states by replay: %s", why)
            return None
        return rewritten.SerializeToString(), plan

    def _switch_to_verify_plan(self) -> None:
        built = self._verify_graph()
        self._verify_strategy = None
        if built is None:
            return
        data, built_plan = built
        plan: VerifyPlan | None = built_plan
        self._release_session()
        try:
            session = self._load(data)
        except Exception:
            log.warning("the verify plan's graph could not be loaded; verifies will replay instead")
            session, plan = self._load(self.prepared.source()[0]), None
        if plan is not None:
            plan.attach(session, self._providers)
        self.session, self._verify_plan = session, plan
        self.epoch += 1

    def serialize_verifies(self, width: int) -> SerialAttention | None:
        """Move the session onto a graph whose forwards of exactly ``width`` tokens compute each position's
        attention as its own single-token call (:mod:`onnxgen.graph.serial_attention`): a verify then
        computes each row as the decode step for it would, where the other kernels compute rows alike.
        Only for a KV cache written in place; a hybrid keeps its verify plan (rewritten the same way).
        Returns the pass's report (None: not applicable, nothing changed); the session in use is released
        before the new one is made."""
        if not self.io.past_present_share_buffer or self.io.token_input is None:
            return None
        with self._verify_lock:
            if self.serial_width is not None:
                return None
            self.prepared = self.prepared.still_on_disk()
            before = self._verify_plan
            graph, plan = self._plan_graph() if before is not None else (self.prepared.load_graph(), None)
            result = serialize_attention(graph, self.io.token_input, width)
            if not result.modified:
                return None
            self._release_session()
            try:
                session = self._load(result.model.SerializeToString())
            except Exception:
                log.warning(
                    "the serial-attention verify graph could not be loaded; running the graph as it was"
                )
                self._switch_back(before is not None)
                return None
            if plan is not None:
                plan.attach(session, self._providers)
            self.session, self._verify_plan, self.serial_width = session, plan, width
            self._serial_aliases = result.report.aliases
            self.epoch += 1
            return result.report

    def _plan_graph(self) -> tuple[onnx.ModelProto, VerifyPlan | None]:
        """The prepared graph rewritten for the verify plan in use, and a new plan object for it."""
        assert self._plan_strategy is not None
        graph, plan, _ = plan_graph(self.prepared.load_graph(), self.io, self._providers, self._plan_strategy)
        return graph, plan

    def _switch_back(self, had_plan: bool) -> None:
        """Load the graph that ran before a failed switch again (with its verify plan, if it had one)."""
        plan = None
        if had_plan:
            graph, plan = self._plan_graph()
            self.session = self._load(graph.SerializeToString())
        else:
            self.session = self._load(self.prepared.source()[0])
        if plan is not None:
            plan.attach(self.session, self._providers)
        self._verify_plan = plan
        self.epoch += 1

    def _release_session(self) -> None:
        """Drop every reference this session's states and binders hold to the onnxruntime session, then the
        session itself (its memory goes before a replacement is loaded); :meth:`current` waits meanwhile."""
        for owner in list(self._binding_owners):
            owner.drop_bindings()
        self.session = None

    def current(self) -> ort.InferenceSession:
        """The onnxruntime session, waiting while it is being replaced (:attr:`verify_plan`)."""
        session = self.session
        if session is None:
            with self._verify_lock:
                session = self.session
        return session

    def track(self, owner: BindingOwner) -> None:
        """Note an object that keeps IO bindings of this session (they are dropped when it is replaced)."""
        self._binding_owners.add(owner)

    def _output_dtype(self, name: str) -> np.dtype:
        t = next(o.type for o in self.session.get_outputs() if o.name == name)
        return np.dtype(np.float16) if t == "tensor(float16)" else np.dtype(np.float32)

    def _vocab_size(self) -> int:
        shape = next(o.shape for o in self.session.get_outputs() if o.name == self.io.logits)
        return int(shape[-1]) if isinstance(shape[-1], int) else -1

    def new_state(self, capacity: int, batch: int = 1) -> DecodeState:
        """An empty decode state holding up to ``capacity`` tokens per row."""
        state = DecodeState(
            self.io, batch=batch, capacity=capacity, shared_kv=self._shared_kv, inplace=self.inplace_states
        )
        self.track(state)
        return state

    def forward(
        self,
        state: DecodeState,
        ids: np.ndarray,
        num_logits: int | None = None,
        *,
        fetch: Sequence[str] = (),
        fetched: dict[str, ort.OrtValue] | None = None,
        copy: bool = True,
        feeds: Mapping[str, np.ndarray] | None = None,
        phase: Phase | None = None,
    ) -> np.ndarray:
        """Run ``ids`` [batch, T] after what ``state`` holds; return logits [batch, N, vocab] for the last
        N = ``num_logits`` positions (all T when None), an array the caller owns.

        ``fetch`` names extra graph outputs (a verify plan's) to put into ``fetched``; such forwards run on
        the main session with bindings of their own, and the values fetched by those of up to ``SMALL_STEP``
        tokens are buffers that the next such forward of as many tokens on this state overwrites. With
        ``copy=False`` the logits may be a view of a buffer that the forward after next on this state
        overwrites, for a caller that consumes them at once (the decode loop saves a logits copy per token).
        ``feeds`` gives graph inputs beyond the decoder's roles by name (an MTP head's hidden-state input),
        each ``[batch, T, ...]``. The :attr:`forward_observer`, if any, sees the forward once it ran, as
        ``phase`` where given (a prefill that keeps two positions' logits), else the phase its shape
        tells."""
        observer = self.forward_observer
        if observer is None:
            return self._forward(state, ids, num_logits, fetch, fetched, copy, feeds)
        started, past = time.perf_counter(), state.length
        logits = self._forward(state, ids, num_logits, fetch, fetched, copy, feeds)
        batch, t = ids.shape
        phase = phase or phase_of(t, logits.shape[1])
        observer(ForwardEvent(phase, batch, t, past, time.perf_counter() - started))
        return logits

    def _forward(
        self,
        state: DecodeState,
        ids: np.ndarray,
        num_logits: int | None,
        fetch: Sequence[str],
        fetched: dict[str, ort.OrtValue] | None,
        copy: bool,
        feeds: Mapping[str, np.ndarray] | None,
    ) -> np.ndarray:
        """:meth:`forward`, unobserved."""
        batch, t = ids.shape
        keep = t if num_logits is None else min(num_logits, t)
        if batch != state.batch:
            raise GenerationError(f"ids have batch {batch} but the decode state was made for {state.batch}")
        if self.vocab_size > 0 and ids.size and not self._ids_in_vocab(ids):
            self._bad_ids(ids, state.length)
        parity = state.steps & 1
        session = self.current() if self.plan is None or fetch else self.plan.session_for(t, parity)
        persistent = bool(fetch) and t <= SMALL_STEP
        serial = t == self.serial_width  # binders of their own, binding each position's present outputs too
        kind = (2 * (t + 1) if persistent else 2 if fetch else 0) + (SERIAL_KIND if serial else 0)
        binder = self._binder(state, session, kind)
        binder.touched += 1
        self._bind_step_inputs(binder, state.length, ids, keep)
        if feeds:
            self._bind_feeds(binder, feeds, t)
        step = state.prepare(t)
        # steady decoding: the same buffers as two steps ago (the very same lists in the steady cycle)
        stale = step.inputs is not binder.state_inputs or step.outputs is not binder.state_outputs
        if stale or binder.allocates:
            self._bind_state(binder, step, self._serial_aliases if serial else None)
        bound = self._bind_fetch(binder, fetch, persistent) if fetch else None
        logits_buf = self._logits_buffer(binder, batch, keep if self.logits_to_keep else t)
        binder.output(self.io.logits, logits_buf.value if logits_buf is not None else None)
        try:
            session.run_with_iobinding(binder.binding, self.step_run_options() if t == 1 else None)
        except Exception as e:
            state.discard(step)
            raise _run_failed(t, state.length, e) from e
        if t > SMALL_STEP:
            self._shrink_pending = True
        allocated = binder.allocated_outputs() if binder.allocates else {}
        state.advance(t, step, allocated)
        if step.cycled and batch == keep == 1 and logits_buf is not None and not binder.allocates:
            if feeds:  # :meth:`step` binds no feeds, so it could never take this forward's lane
                state.bindings.lanes[parity] = None
            else:
                self._keep_lane(state, session, binder, step, logits_buf, parity, fetch)
        logits = allocated[self.io.logits].numpy() if logits_buf is None else logits_buf.array
        if copy and logits_buf is not None:
            logits = logits.copy()
        if fetch:
            self._collect_fetched(binder, fetch, bound, allocated, persistent, fetched)
        return logits if logits.shape[1] == keep else logits[:, -keep:]

    def _keep_lane(
        self,
        state: DecodeState,
        session: ort.InferenceSession,
        binder: Binder,
        step: StepIO,
        logits_buf: HostBuffer,
        parity: int,
        fetch: Sequence[str],
    ) -> None:
        """Leave this step's lane to the next step of its parity: a plain step's, or a fetching step's whose
        fetched outputs are all bound to persistent buffers (the lane carries those buffers)."""
        bound = binder.fetch_bound
        if fetch and (bound is None or bound[0] is not fetch):
            return
        lane = self._lane(state, session, binder, step, logits_buf)
        if lane is not None and fetch and bound is not None:
            lane.fetch, lane.fetched = fetch, bound[1]
        state.bindings.lanes[parity] = lane

    @staticmethod
    def _bind_feeds(binder: Binder, feeds: Mapping[str, np.ndarray], t: int) -> None:
        """Bind a forward's inputs beyond the decoder's roles (:meth:`forward`'s ``feeds``)."""
        for name, value in feeds.items():
            if t <= SMALL_STEP:  # a persistent buffer of the binder, like the token input's
                binder.step_input(name, value.shape, value.dtype.type)[...] = value
            else:
                binder.input(name, HostBuffer.wrap(value).value)

    @staticmethod
    def _bind_state(binder: Binder, step: StepIO, aliases: dict[str, list[str]] | None = None) -> None:
        """Bind the KV / state buffers of ``step`` that ``binder`` does not hold bound already (equal lists
        are bound already; outputs onnxruntime allocates are bound again every run). ``aliases``: more
        outputs to bind to each output's buffer (a serial-attention verify's per-position presents)."""
        if step.inputs is not binder.state_inputs and step.inputs != binder.state_inputs:
            for name, value in step.inputs:
                binder.input(name, value)
            binder.state_inputs = step.inputs
        if (
            step.outputs is not binder.state_outputs and step.outputs != binder.state_outputs
        ) or binder.allocates:
            for name, out in step.outputs:
                binder.output(name, out)
                for alias in aliases.get(name, ()) if aliases else ():
                    binder.output(alias, out)
            binder.state_outputs = step.outputs

    @staticmethod
    def _bind_fetch(
        binder: Binder, fetch: Sequence[str], persistent: bool
    ) -> tuple[Sequence[str], dict[str, ort.OrtValue]] | None:
        """Bind a verify forward's extra outputs. Verify forwards of up to ``SMALL_STEP`` tokens
        (``persistent``) keep a binder per token count, whose fetched outputs become persistent buffers
        after its first run (their shapes depend on batch and token count only). Returns the binder's
        bound buffers (the ``fetch`` list and their values) where it has all of them bound for this very
        list, else None (buffers it kept, or outputs onnxruntime allocates, bound now)."""
        bound = binder.fetch_bound
        if bound is not None and bound[0] is fetch:
            return bound
        for name in fetch:
            kept = binder.fetch_buffers.get(name) if persistent else None
            binder.output(name, kept.value if kept is not None else None)
        if persistent and all(name in binder.fetch_buffers for name in fetch):
            binder.fetch_bound = (fetch, {n: binder.fetch_buffers[n].value for n in fetch})
        return None

    @staticmethod
    def _collect_fetched(
        binder: Binder,
        fetch: Sequence[str],
        bound: tuple[Sequence[str], dict[str, ort.OrtValue]] | None,
        allocated: dict[str, ort.OrtValue],
        persistent: bool,
        fetched: dict[str, ort.OrtValue] | None,
    ) -> None:
        """Put a verify forward's extra outputs into ``fetched``; after the first run of a persistent
        binder, keep buffers shaped like the outputs onnxruntime allocated, bound from the next run on."""
        if bound is not None:  # every fetched output is a persistent buffer bound earlier
            if fetched is not None:
                fetched.update(bound[1])
            return
        got = {n: allocated[n] if n in allocated else binder.fetch_buffers[n].value for n in fetch}
        if persistent:
            for name in allocated.keys() & set(fetch):  # first run at this t: keep buffers like these
                made = allocated[name].numpy()
                binder.fetch_buffers[name] = HostBuffer.wrap(aligned_empty(made.shape, made.dtype))
        if fetched is not None:
            fetched.update(got)

    def step(
        self,
        state: DecodeState,
        token: int,
        fetch: Sequence[str] = (),
        fetched: dict[str, ort.OrtValue] | None = None,
    ) -> np.ndarray:
        """One decode step of a batch-1 ``state``: the logits ``[vocab]`` after ``token``, a view of a
        buffer that the step after next on this state overwrites (consume it first). ``fetch`` / ``fetched``
        as for :meth:`forward` (an MTP head's hidden state; a fetching step takes a lane of its own).

        In steady decoding (see :mod:`onnxgen.runtime.state`) the step takes the lane the last forward of
        its parity left: it writes the token and position into the bound buffers, binds the mask and runs
        onnxruntime's binding objects directly (their wrappers re-check every call what a lane checked
        once). Any other step is an ordinary :meth:`forward` (the class's), which makes the lane."""
        started = time.perf_counter()
        if not 0 <= token < self._vocab_limit:
            self._bad_ids(np.array([token]), state.length)
        parity = state.steps & 1
        lane = state.bindings.lanes[parity]
        if (
            lane is not None
            and lane.touched == lane.binder.touched
            and (lane.fetch is fetch or lane.fetch == fetch)
            and lane.session
            is (self.session if self.plan is None or fetch else self.plan.session_for(1, parity))
            and state.take_cycle(lane.cycle)
        ):
            self._lane_step(state, lane, token, fetched)
            seconds = time.perf_counter() - started
            self._count_lane_step(seconds, state.length - 1)
            if self.plan is not None and not fetch:
                self.plan.observe(parity, seconds)
            return lane.logits
        ids = np.full((1, 1), token, dtype=np.int64)
        # the class's forward, not a wrapper a caller put on this instance's ``forward`` (which sees forwards,
        # not steps); the forward observer sees it as a decode step
        logits = type(self).forward(self, state, ids, 1, fetch=fetch, fetched=fetched, copy=False)[0, -1]
        if self.plan is not None and not fetch:
            self.plan.observe(parity, time.perf_counter() - started)
        return logits

    def _lane_step(
        self, state: DecodeState, lane: StepLane, token: int, fetched: dict[str, ort.OrtValue] | None
    ) -> None:
        """Run ``token`` on ``lane``: write the token, position and mask into its bound buffers and run."""
        past = state.length
        lane.tokens[0, 0] = token
        if lane.positions is not None:
            lane.positions.fill(past)
        held = lane.mask
        if held is not None:
            if held.filled != past:  # a rewind, or steps that ran without a lane
                held.fill(past)
            held.row[past] = 1
            held.filled = past + 1
        elif self.io.attention_mask is not None:
            mask = self._ones(1, past + 1)
            lane.bind_input(self.io.attention_mask, mask)
            lane.binder.record_input(self.io.attention_mask, mask)
        try:
            lane.run(lane.binding, self._shrink_options if self._shrink_pending else self._run_options)
            self._shrink_pending = False
        except Exception as e:
            state.discard(lane.cycle)
            raise _run_failed(1, past, e) from e
        state.commit_cycle()
        if fetched is not None and lane.fetched is not None:
            fetched.update(lane.fetched)

    def _count_lane_step(self, seconds: float, past: int) -> None:
        """Count a lane step, fold its time into :attr:`lane_step_s` (a moving average) and show it to the
        forward observer."""
        self.lane_steps += 1
        seen = self.lane_step_s
        self.lane_step_s = seconds if seen is None else LANE_DECAY * seen + (1.0 - LANE_DECAY) * seconds
        observer = self.forward_observer
        if observer is not None:
            observer(ForwardEvent("decode", 1, 1, past, seconds))

    def step_run_options(self) -> ort.RunOptions | None:
        """The run options of a single-token forward: the arena shrinks after one that follows a prefill;
        otherwise None (the default options). onnxruntime's ``InferenceSession.run_with_iobinding`` looks a
        run-config key up in any options it is given, and the miss raises and catches an exception inside,
        which costs a small forward's time (docs/benchmarks.md, "Figures behind choices in the code")."""
        if self._shrink_pending:
            self._shrink_pending = False
            return self._shrink_options
        return None

    def _ids_in_vocab(self, ids: np.ndarray) -> bool:
        """Whether every id of ``ids`` is in ``[0, vocab_size)``; a few ids are read as Python ints (two
        array reductions cost more than the rest of a small head's forward spends in Python)."""
        if ids.size <= SMALL_STEP:
            values = ids.ravel().tolist()
            return min(values) >= 0 and max(values) < self.vocab_size
        return int(ids.min()) >= 0 and int(ids.max()) < self.vocab_size

    def _bad_ids(self, ids: np.ndarray, past: int) -> NoReturn:
        """Refuse ids outside the vocabulary before running (onnxruntime would fail mid-forward)."""
        bad = sorted({int(i) for i in ids.ravel() if not 0 <= int(i) < self.vocab_size})
        raise GenerationError(
            f"token ids {bad[:5]} at position {past} are outside the model's vocabulary [0, {self.vocab_size}); "
            "nothing was run"
        )

    def _lane(
        self,
        state: DecodeState,
        session: ort.InferenceSession,
        binder: Binder,
        step: StepIO,
        logits: HostBuffer,
    ) -> StepLane | None:
        """The lane of a single-token forward that just ran through ``binder`` on the steady cycle's
        ``step``; None where onnxruntime's binding objects are not the ones this version knows
        (:class:`~onnxgen.runtime.binding.OrtInternals`)."""
        single = binder.single.get(1)
        if self.io.static_cache is not None or single is None:  # static: write indices set by forward()
            return None
        raw = OrtInternals.raw(session, binder.binding, single.token_value)
        if raw is None:
            return None
        held = None
        if self.length_mask and session is self.session:
            assert self.io.attention_mask is not None  # length_mask implies a mask input
            held = state.bindings.lane_mask
            if held is None:
                held = state.bindings.lane_mask = LengthMask(state.capacity, self._dtypes.mask)
            held.fill(state.length)  # the bound mask describes the state from the moment it is bound
            binder.input(self.io.attention_mask, held.buffer.value)
        return StepLane(
            session=session,
            binder=binder,
            touched=binder.touched,
            cycle=step,
            run=raw.run,
            binding=raw.binding,
            bind_input=raw.bind_input,
            tokens=single.tokens,
            positions=single.positions,
            logits=logits.array[0, -1],
            mask=held,
        )

    def _binder(self, state: DecodeState, session: ort.InferenceSession, kind: int = 0) -> Binder:
        # a replaced session's binders (another epoch) hold it alive: they are dropped
        return state.bindings.binder(session, state.steps % 2 + kind, self.epoch)

    def _logits_buffer(self, binder: Binder, batch: int, rows: int) -> HostBuffer | None:
        """A reusable logits output buffer for small fixed shapes (decode steps, kept prefill logits)."""
        if self.vocab_size <= 0 or rows > 16:
            return None
        key = (batch, rows)
        buf = binder.logits.get(key)
        if buf is None:
            buf = binder.logits[key] = HostBuffer.zeros((batch, rows, self.vocab_size), self._logits_dtype)
        return buf

    def _position_shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        """Position ids of ``tokens`` tokens per row: ``[batch, T]``, or ``[3, batch, T]`` (mRoPE)."""
        return (3, batch, tokens) if self.io.position_ids_rank == 3 else (batch, tokens)

    def _single_inputs(self, binder: Binder, batch: int) -> SingleInputs:
        """Bind the binder's persistent buffers of a one-token forward."""
        io = self.io
        tokens = binder.step_input(io.token_input, (batch, 1), self._dtypes.token)
        positions = None
        if io.position_ids is not None:
            positions = binder.step_input(
                io.position_ids, self._position_shape(batch, 1), self._dtypes.position
            )
        keep = binder.step_input(LOGITS_TO_KEEP, (1,), np.int64) if self.logits_to_keep else None
        token_value = binder.bound_input(io.token_input)
        assert token_value is not None
        return SingleInputs(tokens, positions, keep, io.token_input, token_value)

    def _bind_step_inputs(self, binder: Binder, past: int, ids: np.ndarray, keep: int) -> None:
        """Bind the token, mask, position and logits-to-keep inputs of a forward of ``ids`` after ``past``."""
        io = self.io
        batch, t = ids.shape
        if t == 1 and keep == 1:  # a decode step: write into the bound single-token buffers
            single = binder.single.get(batch)
            if single is None or not single.bound(binder):
                single = binder.single[batch] = self._single_inputs(binder, batch)
            single.tokens[...] = ids
            if single.keep is not None:
                single.keep[0] = 1
            if single.positions is not None:
                single.positions.fill(past)
            if io.attention_mask is not None:
                binder.input(io.attention_mask, self._ones(batch, past + 1))
            if io.static_cache is not None:
                self._bind_static(binder.step_input, batch, past, 1)
            return

        def put(name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
            """A bound buffer to write the input into: the binder's persistent one for small forwards."""
            if t <= SMALL_STEP:
                return binder.step_input(name, shape, dtype)
            buf = HostBuffer.wrap(aligned_empty(shape, dtype))
            binder.input(name, buf.value)
            return buf.array

        if self.logits_to_keep:
            put(LOGITS_TO_KEEP, (1,), np.int64)[0] = keep
        put(io.token_input, (batch, t), self._dtypes.token)[...] = ids
        if io.attention_mask is not None:
            binder.input(io.attention_mask, self._ones(batch, past + t))
        if io.position_ids is not None:
            # every row alike; a single position is a scalar fill (no range array in the decode loop)
            put(io.position_ids, self._position_shape(batch, t), self._dtypes.position)[...] = (
                past if t == 1 else np.arange(past, past + t)
            )
        if io.static_cache is not None:
            self._bind_static(put, batch, past, t)

    def _bind_static(
        self, buffer: Callable[[str, tuple[int, ...], type], np.ndarray], batch: int, past: int, t: int
    ) -> None:
        """A static cache's write indices (every row writes at ``past``) and live lengths (``past + t``)."""
        static, dtypes = self.io.static_cache, self._dtypes.static
        assert static is not None and dtypes is not None
        buffer(static.write_indices, (batch,), dtypes[0])[...] = past
        if static.kv_lengths is not None:
            buffer(static.kv_lengths, (batch,), dtypes[1])[...] = past + t
