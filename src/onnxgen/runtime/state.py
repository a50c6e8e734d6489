"""DecodeState: the KV caches, recurrent states and length cursor of one decoding run.

KV caches come in two modes, chosen from the DecoderIO (``io.kv_in_place``):

- *shared*: the graph reads past and writes present in one preallocated buffer: GroupQueryAttention's
  ``[batch, kv_heads, capacity, head_dim]`` (onnxruntime-genai's past_present_share_buffer), or a static
  cache's fixed-length buffer (written with TensorScatter at the write indices the session feeds). The
  state only moves its length cursor, and rewinding is free.
- *growing*: present = concat(past, new); the present OrtValue a forward returns becomes the next past
  as it is (no copy). Rewinding slices. Stacked caches (GPT-2's ``[2, batch, heads, seq, head_dim]``, one
  port per layer) always grow: their attention op writes a new present.

Recurrent states are fixed-shape, zero at start, and double-buffered: a forward reads the current
buffer and writes a spare one, then they swap. Because the current buffer is never written, a
snapshot is a set of references (the snapshotted buffers are pinned so they are not reused as spares)
and restoring it is free.

Steady decoding (shared KV, single-token steps, no snapshot held) alternates
between two fixed sets of bindings: the state keeps both :class:`StepIO` of that cycle and a step takes
and commits one (each state's two buffers swap roles every step; the swaps are counted and made when
something looks at the buffers), instead of rebuilding its lists (the decode loop's
bookkeeping runs with caches the forward just evicted, so what it touches per token counts). Anything
else that moves buffers (a snapshot, restore, release, commit, reset, a multi-token forward) ends the
cycle; the next single-token step starts it again where no snapshot is held (so the plain steps between
speculative verifies run in it too, from the first step after a released snapshot).

In the steady cycle, states named in ``inplace`` (those whose op reads its whole past state before it
writes the present one, see :func:`onnxgen.runtime.graph_cache.inplace_states`) are bound as input and output
of the same buffer instead of swapping: the op then updates one buffer where it copied one into the
other (a faster step: docs/benchmarks.md). Nothing else sees the difference, since no snapshot is held in
the cycle; but a step that fails inside onnxruntime may have written such a state, so the state is then
unusable until :meth:`reset` or :meth:`restore` (ids outside the vocabulary are refused before running).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from onnxgen.errors import GenerationError
from onnxgen.model.io import DecoderIO, StatePair
from onnxgen.runtime.binding import StateBindings
from onnxgen.runtime.buffers import HostBuffer, aligned_copy, aligned_empty, aligned_zeros, dtype_of


@dataclass(frozen=True)
class Snapshot:
    """What :meth:`DecodeState.restore` needs to go back to a point in the run."""

    length: int
    kv: tuple[ort.OrtValue, ...] | None  # growing mode: the past OrtValues (immutable once made)
    states: tuple[HostBuffer, ...]
    epoch: int = 0  # shared mode: forwards prepared before the snapshot (see DecodeState.restore)


@dataclass
class StepIO:
    """The KV/state bindings of one forward (see :meth:`DecodeState.prepare`)."""

    inputs: list[tuple[str, ort.OrtValue]]
    outputs: list[tuple[str, ort.OrtValue | None]]
    writes: list[tuple[_StateSlot, HostBuffer]]
    cycled: bool = False  # one of the steady cycle's two steps (committed by swapping buffers)


class _StateSlot:
    """Current buffer of one recurrent state plus a free list of spares."""

    def __init__(self, pair: StatePair, batch: int) -> None:
        shape = tuple(batch if (i == 0 and not isinstance(d, int)) else d for i, d in enumerate(pair.shape))
        self.pair = pair
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)  # type: ignore[arg-type]
        self.dtype = dtype_of(pair.dtype)
        self.current = HostBuffer.zeros(self.shape, self.dtype)
        self.free: list[HostBuffer] = [HostBuffer.zeros(self.shape, self.dtype)]

    def take_spare(self) -> HostBuffer:
        return self.free.pop() if self.free else HostBuffer.zeros(self.shape, self.dtype)


def joined(parts: Sequence[np.ndarray], axis: int) -> np.ndarray:
    """``parts`` concatenated along ``axis`` into one aligned array."""
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    return np.concatenate(parts, axis=axis, out=aligned_empty(tuple(shape), parts[0].dtype))


def live(array: np.ndarray, axis: int, length: int) -> np.ndarray:
    """The first ``length`` positions of ``array`` along its sequence ``axis`` (a view)."""
    return array[(slice(None),) * axis + (slice(0, length),)]


class DecodeState:
    """KV buffers, recurrent-state buffers and the number of tokens already in them."""

    def __init__(
        self, io: DecoderIO, *, batch: int = 1, capacity: int, shared_kv: bool, inplace: Collection[str] = ()
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        if io.static_cache is not None:  # the buffers' own length; prepare() refuses to run past it
            capacity = min(capacity, io.static_cache.length)
        elif shared_kv:  # a sliding-window GroupQueryAttention refuses a buffer shorter than its window
            capacity = max(capacity, io.min_kv_capacity)
        self.io = io
        self.batch = batch
        self.capacity = capacity
        self.shared_kv = shared_kv
        self.length = 0
        self.steps = 0  # forwards run; its parity picks one of two cached bindings (ping-pong buffers)
        # Cached IO bindings (binders by session and step parity, lanes); filled by the sessions that run
        # this state.
        self.bindings = StateBindings()
        self._pinned: dict[int, int] = {}
        self._slots = [_StateSlot(p, batch) for p in io.state_pairs]
        self._inplace = frozenset(inplace)
        # the states whose two buffers a cycled step swaps (the others are updated in place)
        self._swapped = [slot for slot in self._slots if slot.pair.input not in self._inplace]
        self._broken: str | None = None  # why a failed in-place step left the states unusable
        # reset() leaves the recurrent states as they were and marks them stale: they read as zeros (the
        # next forward binds read-only zero buffers as its past states) until that forward replaces
        # them, or until something reads them (:meth:`_zero_states`), so a request does not write the whole
        # state before its first token.
        self._stale = False
        self._zeros: dict[int, HostBuffer] = {}  # by slot index: a zero past state, never written
        # the steady cycle's StepIO for each step parity (see the module docstring), while valid
        self._cycle: list[StepIO | None] = [None, None]
        self._cycle_from: int | None = None  # ``steps`` when the running cycle's buffers were last synced
        self._make_kv(io, batch, capacity, shared_kv)
        # Shared mode: which forward last wrote each position, so that restoring a snapshot whose
        # positions were overwritten since (restore earlier, run other tokens, restore later) is refused.
        self._epoch = 0
        self._written = np.zeros(capacity if shared_kv else 0, dtype=np.int64)

    def _make_kv(self, io: DecoderIO, batch: int, capacity: int, shared_kv: bool) -> None:
        """The KV buffers (shared: capacity-long, written in place; else empty pasts that grow) and what
        every forward binds for them."""
        self._kv_shared: list[HostBuffer] = []
        self._kv: list[ort.OrtValue] = []
        self._kv_empty: list[ort.OrtValue] = []
        for pair in io.kv_pairs:
            dt = dtype_of(pair.dtype)
            for _ in pair.inputs:
                if shared_kv:
                    self._kv_shared.append(HostBuffer.zeros(pair.buffer_shape(batch, capacity), dt))
                else:
                    empty = aligned_zeros(pair.buffer_shape(batch, 0), dt)
                    self._kv_empty.append(ort.OrtValue.ortvalue_from_numpy(empty))
        self._kv = list(self._kv_empty)
        self._kv_axes = [p.seq_axis for p in io.kv_pairs for _ in p.inputs]  # sequence axis of each past
        self._kv_names_in = [n for p in io.kv_pairs for n in p.inputs]
        self._kv_names_out = [n for p in io.kv_pairs for n in p.outputs]
        # what every forward binds for KV: the shared buffers in place, or outputs onnxruntime allocates
        self._kv_io_in: list[tuple[str, ort.OrtValue]] = []  # growing mode: the pasts of the last step
        self._kv_io_out: list[tuple[str, ort.OrtValue | None]] = [(n, None) for n in self._kv_names_out]
        if shared_kv:
            self._kv_io_in = [(n, b.value) for n, b in zip(self._kv_names_in, self._kv_shared, strict=True)]
            self._kv_io_out = [(n, b.value) for n, b in zip(self._kv_names_out, self._kv_shared, strict=True)]

    # -- binding (used by DecoderSession) ----------------------------------------------------------
    def prepare(self, new_tokens: int) -> StepIO:
        """What a forward over ``new_tokens`` tokens binds: KV and state inputs and outputs.

        Outputs bound to ``None`` are allocated by onnxruntime (growing KV). :meth:`advance` commits
        the step, :meth:`discard` undoes it after a failed forward.
        """
        if self._broken is not None:
            raise GenerationError(self._broken)
        if new_tokens == 1 and self.length < self.capacity and not self._stale:
            cycled = self._cycle[self.steps & 1]
            if cycled is None and self._can_cycle():  # a step after a verify, snapshot, restore...
                self._start_cycle()
                cycled = self._cycle[self.steps & 1]
            if cycled is not None and self.take_cycle(cycled):
                return cycled
        self._end_cycle()
        if self.length + new_tokens > self.capacity:
            held = (
                f"the export's static KV cache holds {self.capacity} positions; shorten the prompt or generate "
                "fewer tokens (or export with a longer static cache)"
                if self.io.static_cache is not None and self.capacity == self.io.static_cache.length
                else "raise the state's capacity (prompt + max_new_tokens) or shorten the prompt"
            )
            raise GenerationError(
                f"sequence would reach {self.length + new_tokens} tokens but the decode state holds "
                f"{self.capacity}; {held}"
            )
        if self.shared_kv:
            self._epoch += 1  # marked before the run: a failed forward may have written too
            self._written[self.length : self.length + new_tokens] = self._epoch
            inputs = list(self._kv_io_in)
        else:
            inputs = list(zip(self._kv_names_in, self._kv, strict=True))
        outputs = list(self._kv_io_out)
        writes = []
        for i, slot in enumerate(self._slots):
            spare = slot.take_spare()
            inputs.append((slot.pair.input, self._zero_past(i) if self._stale else slot.current.value))
            outputs.append((slot.pair.output, spare.value))
            writes.append((slot, spare))
        return StepIO(inputs, outputs, writes)

    def _zero_past(self, i: int) -> ort.OrtValue:
        """A zero state of slot ``i``'s shape for a stale state's forward to read (allocated once, never
        written, so its pages are the kernel's shared zero page)."""
        buf = self._zeros.get(i)
        if buf is None:
            slot = self._slots[i]
            buf = self._zeros[i] = HostBuffer.wrap(aligned_zeros(slot.shape, slot.dtype))
        return buf.value

    def _zero_states(self) -> None:
        """Write the zeros a stale state stands for into its buffers (before anything reads them)."""
        if self._stale:
            for slot in self._slots:
                slot.current.array.fill(0)
            self._stale = False

    def take_cycle(self, step: StepIO) -> bool:
        """:meth:`prepare` for one token where ``step`` is what it would return (the running cycle's
        StepIO for the next step); False, with nothing done, where it is not. Commit with
        :meth:`commit_cycle`, undo with :meth:`discard`. (A prepared decode step takes this instead of
        :meth:`prepare` and :meth:`advance`: fewer calls with caches a forward evicted.)"""
        if (
            self._cycle[self.steps & 1] is not step
            or self.length >= self.capacity
            or self._broken is not None
        ):
            return False
        self._epoch += 1
        self._written[self.length] = self._epoch
        return True

    def commit_cycle(self) -> None:
        """:meth:`advance` of a one-token step that :meth:`take_cycle` started. Each such step swaps every
        double-buffered state's current buffer with its spare; the swaps are counted rather than made
        (:meth:`_sync_cycle`), since the cycle's bindings already alternate (swapping every state's buffers
        per token costs time with caches a forward just evicted)."""
        self.length += 1
        self.steps += 1

    def _sync_cycle(self) -> None:
        """Make each double-buffered state's ``current`` the buffer the running cycle's last step wrote:
        swapped once if an odd number of cycled steps ran since the cycle started or last synced."""
        if self._cycle_from is None:
            return
        if (self.steps - self._cycle_from) & 1:
            for slot in self._swapped:
                slot.current, slot.free[-1] = slot.free[-1], slot.current
        self._cycle_from = self.steps

    def advance(
        self,
        new_tokens: int,
        step: StepIO,
        allocated: dict[str, ort.OrtValue],
    ) -> None:
        """Commit a finished forward: move the cursor, take presents as the next pasts, swap states.

        ``allocated`` holds the outputs onnxruntime allocated (growing KV), by name.
        """
        if step.cycled:  # (a one-token step)
            self.commit_cycle()
            return
        self.length += new_tokens
        self.steps += 1
        self._stale = False  # every state was written by this forward
        if not self.shared_kv:
            self._kv = [allocated[n] for n in self._kv_names_out]
        for slot, spare in step.writes:
            old = slot.current
            slot.current = spare
            if id(old) not in self._pinned:
                slot.free.append(old)
        if new_tokens == 1 and self._can_cycle():
            self._start_cycle()

    def _can_cycle(self) -> bool:
        """Whether single-token steps may run the steady cycle from here: shared KV, no snapshot pinning a
        buffer, a spare for every state."""
        return self.shared_kv and not self._pinned and all(s.free for s in self._slots)

    def _end_cycle(self) -> None:
        """Something moved buffers outside the steady cycle: the next steps take spares again."""
        self._sync_cycle()
        self._cycle = [None, None]
        self._cycle_from = None

    def _start_cycle(self) -> None:
        """Make the two StepIO of steady decoding from here: each state swaps its current buffer with the
        spare a step would take next (the last free one), as taking it and freeing the old one would."""
        self._sync_cycle()
        kv_in, kv_out = list(self._kv_io_in), list(self._kv_io_out)
        pairs = [(slot.current, slot.free[-1]) for slot in self._slots]
        for parity, flip in ((self.steps & 1, False), ((self.steps + 1) & 1, True)):
            inputs, outputs, writes = list(kv_in), list(kv_out), []
            for slot, (now, spare) in zip(self._slots, pairs, strict=True):
                if slot.pair.input in self._inplace:
                    read = write = now
                else:
                    read, write = (spare, now) if flip else (now, spare)
                inputs.append((slot.pair.input, read.value))
                outputs.append((slot.pair.output, write.value))
                writes.append((slot, write))
            self._cycle[parity] = StepIO(inputs, outputs, writes, cycled=True)
        self._cycle_from = self.steps

    def discard(self, step: StepIO) -> None:
        """Undo :meth:`prepare` after a failed forward (returns the spares)."""
        if step.cycled:  # nothing was taken; the written KV positions are marked in _written
            if len(self._swapped) < len(self._slots):
                self._broken = (
                    f"a forward at position {self.length} failed after it may have updated recurrent states "
                    "in place; reset() the decode state (or restore a snapshot) before running it again"
                )
            return
        for slot, spare in step.writes:
            slot.free.append(spare)

    # -- snapshot / restore / rewind ------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Remember this point (free: references, not copies). Pair with :meth:`release`."""
        self._zero_states()
        self._end_cycle()  # pinned buffers must not be written: steps take spares again
        states = tuple(slot.current for slot in self._slots)
        for buf in states:
            self._pinned[id(buf)] = self._pinned.get(id(buf), 0) + 1
        kv = None if self.shared_kv else tuple(self._kv)
        return Snapshot(self.length, kv, states, self._epoch)

    def restore(self, snap: Snapshot) -> None:
        """Go back to ``snap``: length, KV and recurrent states exactly as they were."""
        self._end_cycle()
        if self.shared_kv and snap.length and int(self._written[: snap.length].max()) > snap.epoch:
            raise GenerationError(
                f"cannot restore a snapshot at length {snap.length}: forwards since it was taken have "
                "overwritten its positions in the shared KV buffer; restore an earlier snapshot and re-run "
                "the tokens instead"
            )
        self.length = snap.length
        self._stale = False  # the snapshot's buffers hold its states (zeros written if it was stale)
        self._broken = None  # the snapshot's buffers were pinned: no in-place step wrote them
        if snap.kv is not None:
            self._kv = list(snap.kv)
        for slot, buf in zip(self._slots, snap.states, strict=True):
            if slot.current is not buf and id(slot.current) not in self._pinned:
                slot.free.append(slot.current)
            slot.current = buf

    def release(self, snap: Snapshot) -> None:
        """Forget ``snap``; its buffers become reusable once nothing else pins them."""
        self._end_cycle()
        for slot, buf in zip(self._slots, snap.states, strict=True):
            n = self._pinned.get(id(buf), 0) - 1
            if n > 0:
                self._pinned[id(buf)] = n
                continue
            self._pinned.pop(id(buf), None)
            if slot.current is not buf and all(f is not buf for f in slot.free):
                slot.free.append(buf)

    def rewind(self, length: int) -> None:
        """Truncate the KV caches to ``length`` tokens. Recurrent states cannot be rewound this way."""
        if length > self.length or length < 0:
            raise ValueError(f"rewind length must be in [0, {self.length}] (got {length})")
        if length == self.length:
            return
        if self._slots:
            raise GenerationError(
                "a hybrid model's recurrent state cannot be rewound by truncation; "
                "restore a snapshot and re-run the kept tokens instead"
            )
        self._truncate_kv(length)

    def _truncate_kv(self, length: int) -> None:
        self.length = length
        if not self.shared_kv:
            self._kv = [
                ort.OrtValue.ortvalue_from_numpy(aligned_copy(live(v.numpy(), axis, length)))
                for v, axis in zip(self._kv, self._kv_axes, strict=True)
            ]

    def spare_states(self) -> list[HostBuffer]:
        """A free buffer per recurrent state (``io.state_pairs`` order), to fill and pass to :meth:`commit`."""
        self._end_cycle()
        return [slot.take_spare() for slot in self._slots]

    def commit(self, length: int, states: list[HostBuffer]) -> None:
        """Keep the first ``length`` tokens of the KV caches and make ``states`` (from :meth:`spare_states`,
        filled with the states after those tokens) the recurrent states: a rewind for hybrid models."""
        if length > self.length or length < 0 or len(states) != len(self._slots):
            raise ValueError(
                f"commit needs a length in [0, {self.length}] and {len(self._slots)} states "
                f"(got {length} and {len(states)})"
            )
        self._end_cycle()
        self._stale = False
        if length != self.length:
            self._truncate_kv(length)
        for slot, buf in zip(self._slots, states, strict=True):
            if id(slot.current) not in self._pinned:
                slot.free.append(slot.current)
            slot.current = buf

    # -- prefix cache -----------------------------------------------------------------------------------
    def kv_slice(self, start: int, end: int) -> list[np.ndarray]:
        """Copies of positions ``[start, end)`` of every past KV tensor (``io.kv_pairs`` input order, the
        graph's layout), ``end`` at most the state's length."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"KV positions [{start}, {end}) are outside the state's [0, {self.length})")
        values = [b.array for b in self._kv_shared] if self.shared_kv else [v.numpy() for v in self._kv]
        return [
            np.array(a[(slice(None),) * axis + (slice(start, end),)], copy=True)
            for a, axis in zip(values, self._kv_axes, strict=True)
        ]

    def load_prefix(self, length: int, kv: list[list[np.ndarray]], states: list[np.ndarray] | None) -> None:
        """Make an empty state hold a cached prefix of ``length`` tokens: ``kv`` gives, per past KV tensor,
        consecutive pieces of its first ``length`` positions (copied in); ``states`` the recurrent states
        after them (``io.state_pairs`` order, copied in)."""
        if self.length != 0:
            raise GenerationError(
                f"a prefix is loaded into an empty decode state (this one holds {self.length})"
            )
        if length > self.capacity or len(kv) != len(self._kv_axes) or len(states or ()) != len(self._slots):
            raise ValueError(
                f"a prefix of {length} tokens with {len(kv)} KV tensors and {len(states or ())} states does not "
                f"fit this state ({self.capacity} positions, {len(self._kv_axes)} KV tensors, {len(self._slots)} states)"
            )
        self._end_cycle()
        if self.shared_kv:
            self._epoch += 1
            self._written[:length] = self._epoch
            for buf, parts, axis in zip(self._kv_shared, kv, self._kv_axes, strict=True):
                at = 0
                for part in parts:
                    n = part.shape[axis]
                    buf.array[(slice(None),) * axis + (slice(at, at + n),)] = part
                    at += n
        else:
            self.bindings.clear()  # bound pasts of an earlier run would otherwise stay alive
            self._kv = [
                ort.OrtValue.ortvalue_from_numpy(joined(parts, axis))
                for parts, axis in zip(kv, self._kv_axes, strict=True)
            ]
        for slot, array in zip(self._slots, states or (), strict=True):
            if id(slot.current) in self._pinned:
                slot.current = slot.take_spare()
            slot.current.array[...] = array
        self._stale = False  # (a reset state's states read as zeros until written: every one is written now)
        self._broken = None
        self.length = length

    # -- inspection (tests, debugging) ----------------------------------------------------------------
    def kv_arrays(self, copy: bool = True) -> dict[str, np.ndarray]:
        """The live part of every past KV tensor, by input name (in the graph's layout): copies, or with
        ``copy=False`` views that the next forward or reset of this state overwrites (for a caller that
        copies them elsewhere at once)."""
        values = [b.array for b in self._kv_shared] if self.shared_kv else [v.numpy() for v in self._kv]
        views = {
            n: live(a, axis, self.length)
            for n, a, axis in zip(self._kv_names_in, values, self._kv_axes, strict=True)
        }
        return {n: v.copy() for n, v in views.items()} if copy else views

    def state_arrays(self, copy: bool = True) -> dict[str, np.ndarray]:
        """Every recurrent state by input name: copies, or with ``copy=False`` views of this state's
        buffers (as :meth:`kv_arrays`)."""
        self._sync_cycle()
        self._zero_states()
        return {s.pair.input: s.current.array.copy() if copy else s.current.array for s in self._slots}

    @property
    def nbytes(self) -> int:
        """Bytes of the KV buffers (capacity-sized where shared; the current ones where they grow) and
        of the recurrent-state buffers (spares included). Pages never written are not resident."""
        kv = sum(b.array.nbytes for b in self._kv_shared) if self.shared_kv else 0
        if not self.shared_kv:
            kv = sum(v.numpy().nbytes for v in self._kv)
        states = sum(b.array.nbytes for s in self._slots for b in (s.current, *s.free))
        return kv + states

    def drop_bindings(self) -> None:
        """Forget the IO bindings and lanes made for this state (their session is being replaced)."""
        self.bindings.drop()

    def reset(self) -> None:
        """Back to an empty sequence: length 0, zero states."""
        if not self.shared_kv:  # bound pasts of the last run would otherwise stay alive
            self.bindings.clear()
        # Shared KV: the bindings point at this state's own buffers (and their binders' persistent input,
        # logits and verify-output buffers), so they are kept for the next run on this state: a verify
        # of a token count seen before binds nothing new (no request's first verify of a draft length
        # pays for making its binder again).
        self.length = 0
        self._broken = None
        self._end_cycle()
        for slot in self._slots:
            if id(slot.current) in self._pinned:
                slot.current = slot.take_spare()
        self._stale = bool(self._slots)
        self._kv = list(self._kv_empty)
