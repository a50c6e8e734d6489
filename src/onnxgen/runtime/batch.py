"""Batched decoding: many sequences, one forward per step, each row with its own length.

A :class:`BatchState` holds rows ``[0, n)`` of ``[max_batch, ...]`` KV and recurrent-state buffers. A new
sequence is prefilled alone (batch 1, no padding) in an ordinary :class:`DecodeState` and copied into row
``n`` (:meth:`BatchState.admit`); a decode step (:meth:`BatchState.step`) then feeds exactly one real token
per row, so no padded position ever enters a recurrent state, and a row's output does not depend on what
else is in the batch. Retiring a row moves the last row into its slot, so live rows stay compacted and
every forward binds contiguous views ``buffer[:n]``.

``min_rows`` pads every forward to at least that many rows with idle rows (length 0, fed a token of their
own, never read). Some kernels take a different path for one row than for several (onnxruntime's int4
MatMulNBits, on int8 or fp32 activations, computes a single row differently from a block of rows on some CPUs;
rows of a block are computed alike whatever their neighbours), so with ``min_rows=2`` a sequence's logits
no longer depend on whether it had company at any step (:func:`invariant_min_rows`).

Per-row lengths drive the attention mask and position ids:

- *shared* KV (GroupQueryAttention, static caches): row ``r`` keeps its tokens at ``[0, len_r)`` of its
  row of the max-length buffer; the mask is right-padded (ones in ``[0, len_r + 1)``), which is how GQA
  reads each row's past length, and a static cache writes row ``r``'s token at ``len_r`` (its write
  index) and reads ``len_r + 1`` positions of it.
- *growing* KV (present = concat(past, new); stacked caches too): rows share one past length ``P``; row
  ``r`` keeps its tokens at ``[P - len_r, P)`` (left-padded, mask zeros before them), so new tokens append
  contiguously and retiring the longest row trims the common prefix. Where the attention reads each
  row's length from its mask (GroupQueryAttention, ``io.lengths_from_mask``) rows are right-padded
  instead: tokens at ``[0, len_r)``, and the op writes each row's new token at its own length.

Caches are handled through :func:`rows_first`, a view of a cache with the batch axis first and the
sequence axis second, whatever the graph's layout (``[2, batch, heads, seq, dim]`` for a stacked cache).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from onnxgen.errors import GenerationError
from onnxgen.graph.logits_to_keep import LOGITS_TO_KEEP
from onnxgen.model.io import KVPair
from onnxgen.runtime.binding import Binder, StateBindings
from onnxgen.runtime.buffers import HostBuffer, IndexDtypes, aligned_zeros, dtype_of
from onnxgen.runtime.observer import ForwardEvent
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState


def rows_first(array: np.ndarray, pair: KVPair) -> np.ndarray:
    """A view of one of ``pair``'s cache tensors as ``[batch, seq, ...]``."""
    return np.moveaxis(array, (pair.batch_axis, pair.seq_axis), (0, 1))


def invariant_min_rows(graph: onnx.ModelProto, session: DecoderSession | None = None) -> int:
    """The ``min_rows`` that makes a sequence's logits independent of its company: 1 where a row is computed
    alike alone or in a block (fp32 kernels always are), 2 where it may not be.

    A MatMulNBits node may compute a single row on another kernel than a block of rows, on int8
    activations (``accuracy_level`` 4) and on fp32 ones alike; which one onnxruntime picks depends on the
    CPU (on an AVX2-only CPU the logits of a lone row differed from the same row's in a block, on one with
    AVX-512 VNNI they were the same bits with int8 activations: docs/benchmarks.md). Without ``session``
    such a graph gets 2; with it, :func:`lone_row_matches_block` decides on this machine, and 1 spares a
    lone request the 2-row step."""
    if not any(node.op_type == "MatMulNBits" for node in graph.graph.node):
        return 1
    return 1 if session is not None and lone_row_matches_block(session) else 2


def lone_row_matches_block(session: DecoderSession, steps: int = 3) -> bool:
    """Whether ``session`` computes a sequence's decode steps to the same bits alone and beside another:
    a 3-token prompt decoded ``steps`` tokens as a batch of one row and then of two (a few forwards of
    tiny shapes; the kernel choice does not depend on the values, and where two kernels differ nearly
    every logit does)."""
    vocab = session.vocab_size if session.vocab_size > 0 else 8
    prompts = ([1 % vocab, 2 % vocab, 3 % vocab], [4 % vocab, 5 % vocab])
    capacity = len(prompts[0]) + steps + 1
    runs = []
    for company in (False, True):
        batch = BatchState(session, 2, capacity)
        for prompt in prompts[: 1 + company]:
            state = session.new_state(capacity)
            session.forward(state, np.array([prompt], dtype=np.int64), 1)
            batch.admit(state)
        runs.append(np.stack([batch.step([(6 + t) % vocab] * batch.n)[0] for t in range(steps)]))
    return bool(np.array_equal(runs[0], runs[1]))


class RowBuffer:
    """A ``[max_batch, ...]`` host buffer and OrtValues over its leading rows ``[:n]`` (made once per n)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.array = aligned_zeros(shape, dtype)
        self._views: dict[int, HostBuffer] = {}

    def rows(self, n: int) -> ort.OrtValue:
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = HostBuffer(
                self.array[:n], ort.OrtValue.ortvalue_from_numpy(self.array[:n])
            )
        return view.value


class BatchState:
    """Up to ``max_batch`` sequences of up to ``capacity`` tokens each, decoded together."""

    def __init__(self, session: DecoderSession, max_batch: int, capacity: int, min_rows: int = 1) -> None:
        if max_batch < 1 or capacity < 2 or min_rows < 1:
            raise ValueError(
                f"max_batch, min_rows must be >= 1 and capacity >= 2 (got {max_batch}, {min_rows}, {capacity})"
            )
        if session.io.past_present_share_buffer:  # a sliding-window GroupQueryAttention needs its window
            capacity = max(capacity, session.io.min_kv_capacity)
        self.min_rows = min(min_rows, max_batch)
        self.session = session
        self.io = io = session.io
        self.max_batch = max_batch
        self.capacity = capacity
        self.shared_kv = io.kv_in_place
        self.n = 0
        self.lengths = np.zeros(max_batch, dtype=np.int64)  # tokens in the KV/state of each row
        self.steps = 0
        if io.static_cache is not None and capacity > io.static_cache.length:
            raise ValueError(
                f"capacity {capacity} exceeds the export's static KV cache of {io.static_cache.length} positions"
            )
        self._kv_in = [name for pair in io.kv_pairs for name in pair.inputs]
        self._kv_out = [name for pair in io.kv_pairs for name in pair.outputs]
        self._kv_pairs = [pair for pair in io.kv_pairs for _ in pair.inputs]  # the pair of each cache tensor
        self._kv_shared: list[RowBuffer] = []
        if self.shared_kv:  # (batch axis first in every in-place layout)
            self._kv_shared = [
                RowBuffer(pair.buffer_shape(max_batch, capacity), dtype_of(pair.dtype))
                for pair in self._kv_pairs
            ]
        self._past = 0  # growing mode: the common past length of every row
        self._left = not io.lengths_from_mask  # growing mode: rows end at the common past (left-padded)
        self._kv_grown: list[HostBuffer | ort.OrtValue] = []
        self._state_in = [pair.input for pair in io.state_pairs]
        self._state_out = [pair.output for pair in io.state_pairs]
        self._states: list[RowBuffer] = []
        self._spares: list[RowBuffer] = []
        # states the session's ops update in place (input and output bound to one buffer, never swapped)
        self._inplace = [pair.input in session.inplace_states for pair in io.state_pairs]
        for pair in io.state_pairs:
            shape = (max_batch, *(int(d) for d in pair.shape[1:]))  # type: ignore[arg-type]
            self._states.append(RowBuffer(shape, dtype_of(pair.dtype)))
            self._spares.append(RowBuffer(shape, dtype_of(pair.dtype)))
        self._bindings = StateBindings()
        session.track(self)  # its binders are dropped when the session is replaced
        self._dtypes = IndexDtypes.of(io)
        vocab = session.vocab_size
        self._logits = RowBuffer((max_batch, 1, vocab), np.dtype(np.float32)) if vocab > 0 else None
        logits_type = next(o.type for o in session.session.get_outputs() if o.name == io.logits)
        if logits_type != "tensor(float)":
            self._logits = None  # let onnxruntime allocate (float16 logits)

    def drop_bindings(self) -> None:
        """Forget the binders made for this batch (their session is being replaced)."""
        self._bindings.drop()

    @property
    def free_rows(self) -> int:
        return self.max_batch - self.n

    @property
    def bound_rows(self) -> int:
        """Rows a forward runs: the live ones, padded with idle rows up to ``min_rows``."""
        return max(self.n, self.min_rows) if self.n else 0

    # -- admission and retirement -----------------------------------------------------------------------
    def admit(self, prefilled: DecodeState, source: int = 0) -> int:
        """Copy row ``source`` of a prefilled state (its KV prefix and recurrent states; a batched prefill's
        state holds one prompt a row, all of one length) into row ``n``; return ``n``."""
        if not 0 <= source < prefilled.batch:
            raise ValueError(
                f"source must be a row of the prefilled state, in [0, {prefilled.batch}) (got {source})"
            )
        if self.n >= self.max_batch:
            raise GenerationError(f"the batch is full ({self.max_batch} rows); retire a row first")
        length = prefilled.length
        if not 0 < length < self.capacity:
            raise GenerationError(
                f"a prefilled sequence of {length} tokens does not fit a batch row of {self.capacity} "
                "(it needs room for at least one more token); raise the batch capacity"
            )
        row = self.n
        kv = prefilled.kv_arrays(copy=False)  # views, copied into the row here (one copy, not two)
        if self.shared_kv:
            for name, buf, pair in zip(self._kv_in, self._kv_shared, self._kv_pairs, strict=True):
                rows_first(buf.array, pair)[row, :length] = rows_first(kv[name], pair)[source]
        else:
            self._admit_grown([kv[name] for name in self._kv_in], length, source)
        states = prefilled.state_arrays(copy=False)
        for name, buf in zip(self._state_in, self._states, strict=True):
            buf.array[row] = states[name][source]
        self.lengths[row] = length
        self.n += 1
        return row

    def load_row(self, row: int, state: DecodeState) -> None:
        """Copy ``row`` (its KV prefix and recurrent states) into a batch-1 ``state``, emptied first: the
        inverse of :meth:`admit`, so that the sequence decodes on from ``state`` to the same bits."""
        if state.batch != 1:
            raise ValueError(f"load_row() fills a batch-1 decode state (got batch {state.batch})")
        if not 0 <= row < self.n:
            raise ValueError(f"row must be in [0, {self.n}) (got {row})")
        kv, states = self.row_kv(row), self.row_states(row)
        pieces = [
            [np.expand_dims(kv[name], pair.batch_axis)]
            for name, pair in zip(self._kv_in, self._kv_pairs, strict=True)
        ]
        state.reset()
        state.load_prefix(int(self.lengths[row]), pieces, [states[name] for name in self._state_in])

    def _grown_arrays(self) -> list[np.ndarray]:
        return [v.array if isinstance(v, HostBuffer) else v.numpy() for v in self._kv_grown]

    def _set_grown(self, arrays: list[np.ndarray]) -> None:
        self._kv_grown = [HostBuffer.wrap(a) for a in arrays]

    def _admit_grown(self, kv: list[np.ndarray], length: int, source: int) -> None:
        """Growing KV: left-pad the new row (row ``source`` of ``kv``), or every old row, so all rows end at
        the common past."""
        n = self.n
        past = max(self._past, length) if n else length
        rows = max(n + 1, self.min_rows)
        olds = self._grown_arrays() if n else [None] * len(kv)
        merged = []
        shift, start = (past - self._past, past - length) if self._left else (0, 0)
        for old, new, pair in zip(olds, kv, self._kv_pairs, strict=True):
            out = aligned_zeros(pair.buffer_shape(rows, past), new.dtype)
            if old is not None:
                rows_first(out, pair)[:n, shift : shift + self._past] = rows_first(old, pair)[:n]
            rows_first(out, pair)[n, start : start + length] = rows_first(new, pair)[source]
            merged.append(out)
        self._past = past
        self._set_grown(merged)

    def retire(self, row: int) -> int | None:
        """Free ``row``: the last row moves into it. Returns the moved row's old index (None: none moved)."""
        if not 0 <= row < self.n:
            raise ValueError(f"row must be in [0, {self.n}) (got {row})")
        last = self.n - 1
        if self.shared_kv:
            length = int(self.lengths[last])
            for buf, pair in zip(self._kv_shared, self._kv_pairs, strict=True):
                if row != last:
                    view = rows_first(buf.array, pair)
                    view[row, :length] = view[last, :length]
        for buf in self._states:
            if row != last:
                buf.array[row] = buf.array[last]
        self.lengths[row] = self.lengths[last]
        self.lengths[last] = 0
        self.n = last
        if not self.shared_kv:
            self._retire_grown(row, last)
        return last if row != last else None

    def _retire_grown(self, row: int, last: int) -> None:
        if self.n == 0:
            self._kv_grown, self._past = [], 0
            return
        order = list(range(self.n))
        if row != last:
            order[row] = last
        past = int(self.lengths[: self.n].max())
        trimmed = []
        for a, pair in zip(self._grown_arrays(), self._kv_pairs, strict=True):
            out = aligned_zeros(pair.buffer_shape(self.bound_rows, past), a.dtype)
            kept = slice(self._past - past, self._past) if self._left else slice(0, past)
            rows_first(out, pair)[: self.n] = rows_first(a, pair)[order, kept]
            trimmed.append(out)
        self._past = past
        self._set_grown(trimmed)

    # -- one batched forward ------------------------------------------------------------------------------
    def step(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Feed one token per live row (``tokens[r]`` to row ``r``); return logits ``[n, vocab]`` (a copy).
        The session's forward observer, if any, sees the step once it ran."""
        observer = self.session.forward_observer
        if observer is None:
            return self._step(tokens)
        started, past = time.perf_counter(), int(self.lengths[: self.n].max(initial=0))
        logits = self._step(tokens)
        observer(ForwardEvent("decode", len(logits), 1, past, time.perf_counter() - started))
        return logits

    def _step(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """:meth:`step`, unobserved."""
        n, m = self.n, self.bound_rows
        tokens = np.asarray(tokens, dtype=self._dtypes.token).reshape(-1)
        if n == 0 or len(tokens) != n:
            raise GenerationError(f"step() needs one token per live row ({n} rows, got {len(tokens)} tokens)")
        tokens = np.concatenate([tokens, np.full(m - n, tokens[0], dtype=tokens.dtype)]) if m > n else tokens
        if int(self.lengths[:n].max()) + 1 > self.capacity:
            raise GenerationError(
                f"a batch row would exceed its capacity of {self.capacity} tokens; retire it first"
            )
        run = self.session.current() if self.session.plan is None else self.session.plan.session_for(1)
        # two binders per session: the recurrent states ping-pong between two buffers (but the ones updated
        # in place)
        binder = self._bindings.binder(run, self.steps % 2)
        small = self._bind_small_inputs(binder.binding, tokens)
        self._bind_caches(binder, m)
        if self._logits is not None:
            binder.output(self.io.logits, self._logits.rows(m))
        else:
            binder.output(self.io.logits, None)
        try:
            run.run_with_iobinding(binder.binding, self.session.step_run_options())
        except Exception as e:
            raise GenerationError(f"batched decode step over {n} rows failed: {e}") from e
        del small  # the bound step inputs had to stay alive until the run
        allocated = binder.allocated_outputs() if binder.allocates else {}
        self._advance(n, allocated)
        if self._logits is not None:
            return self._logits.array[:n, 0].copy()
        return allocated[self.io.logits].numpy()[:n, -1].astype(np.float32)

    def _bind_small_inputs(self, binding: ort.IOBinding, tokens: np.ndarray) -> list[np.ndarray]:
        io, n = self.io, len(tokens)
        lengths = self.lengths[:n]  # idle rows have length 0: they attend to their own token only
        arrays = [np.ascontiguousarray(tokens.reshape(n, 1))]
        binding.bind_cpu_input(io.token_input, arrays[-1])
        if self.session.logits_to_keep:
            arrays.append(np.array([1], dtype=np.int64))
            binding.bind_cpu_input(LOGITS_TO_KEEP, arrays[-1])
        if io.attention_mask is not None:
            if self.shared_kv or not self._left:  # right-padded: ones in [0, len + 1)
                width = int(lengths.max()) + 1 if self.shared_kv else self._past + 1
                mask = np.arange(width)[None, :] < (lengths + 1)[:, None]
            else:  # left-padded: ones in [past - len, past + 1)
                mask = np.arange(self._past + 1)[None, :] >= (self._past - lengths)[:, None]
            arrays.append(np.ascontiguousarray(mask, dtype=self._dtypes.mask))
            binding.bind_cpu_input(io.attention_mask, arrays[-1])
        if io.position_ids is not None:
            pos: np.ndarray = lengths.reshape(n, 1).astype(self._dtypes.position)
            if io.position_ids_rank == 3:
                pos = np.broadcast_to(pos, (3, n, 1))
            arrays.append(np.ascontiguousarray(pos))
            binding.bind_cpu_input(io.position_ids, arrays[-1])
        static, dtypes = io.static_cache, self._dtypes.static
        if static is not None and dtypes is not None:  # each row writes at its own length
            arrays.append(lengths.astype(dtypes[0]))
            binding.bind_cpu_input(static.write_indices, arrays[-1])
            if static.kv_lengths is not None:
                arrays.append((lengths + 1).astype(dtypes[1]))
                binding.bind_cpu_input(static.kv_lengths, arrays[-1])
        return arrays

    def _bind_caches(self, binder: Binder, n: int) -> None:
        if self.shared_kv:
            for n_in, n_out, buf in zip(self._kv_in, self._kv_out, self._kv_shared, strict=True):
                binder.input(n_in, buf.rows(n))
                binder.output(n_out, buf.rows(n))
        else:
            for n_in, n_out, value in zip(self._kv_in, self._kv_out, self._kv_grown, strict=True):
                binder.input(n_in, value.value if isinstance(value, HostBuffer) else value)
                binder.output(n_out, None)
        for n_in, n_out, cur, spare, inplace in zip(
            self._state_in, self._state_out, self._states, self._spares, self._inplace, strict=True
        ):
            binder.input(n_in, cur.rows(n))
            binder.output(n_out, cur.rows(n) if inplace else spare.rows(n))

    def _advance(self, n: int, allocated: dict[str, ort.OrtValue]) -> None:
        self.lengths[:n] += 1
        self.steps += 1
        if not self.shared_kv:
            self._past += 1
            self._kv_grown = [allocated[name] for name in self._kv_out]
        for i, inplace in enumerate(self._inplace):
            if not inplace:
                self._states[i], self._spares[i] = self._spares[i], self._states[i]

    # -- inspection (tests, debugging) --------------------------------------------------------------------
    def row_kv(self, row: int) -> dict[str, np.ndarray]:
        """The live KV of ``row`` by past input name, in the graph's layout without the batch axis (copies)."""
        length = int(self.lengths[row])
        arrays = [b.array for b in self._kv_shared] if self.shared_kv else self._grown_arrays()
        start = self._past - length if not self.shared_kv and self._left else 0
        out = {}
        for name, array, pair in zip(self._kv_in, arrays, self._kv_pairs, strict=True):
            index: list[int | slice] = [slice(None)] * array.ndim
            index[pair.batch_axis], index[pair.seq_axis] = row, slice(start, start + length)
            out[name] = array[tuple(index)].copy()
        return out

    def row_states(self, row: int) -> dict[str, np.ndarray]:
        """The recurrent states of ``row`` by input name (copies)."""
        return {n: b.array[row].copy() for n, b in zip(self._state_in, self._states, strict=True)}
