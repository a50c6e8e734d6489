"""Decoder I/O topology: which graph port plays which role.

A model is described by one :class:`DecoderIO`, derived once at load (see :mod:`onnxgen.model.derive`).
Precedence: ``inference_metadata`` ``model.io`` (declared) > ``genai_config.json`` name templates > the
graph's port names and shapes.

Shapes are tuples whose entries are an ``int`` (static extent) or a ``str`` (symbolic axis name);
``None`` stands for an unnamed dynamic axis. A port whose rank the graph does not state (an output
declared without a shape) has ``shape == ()`` and ``rank_known == False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Dim = int | str | None
Shape = tuple[Dim, ...]
IOSource = Literal["declared", "genai_config", "graph"]


@dataclass(frozen=True)
class Port:
    """One graph input or output: its name, element type (numpy dtype name) and shape."""

    name: str
    dtype: str
    shape: Shape
    rank_known: bool = True

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        """Every axis has a concrete extent."""
        return self.rank_known and all(isinstance(d, int) for d in self.shape)


KV_LAYOUTS = ("BNSH", "stacked", "static")


@dataclass(frozen=True)
class KVPair:
    """Past/present key and value of one attention layer.

    ``layout`` says how the cache is laid out and fed:

    - ``"BNSH"``: a key and a value port, ``[batch, kv_heads, seq, head_dim]``; present is past plus the new
      tokens (or, with ``DecoderIO.past_present_share_buffer``, the same max-length buffer).
    - ``"stacked"``: one port per layer (GPT-2 style ``past_N`` -> ``present_N``), key and value stacked on
      axis 0: ``[2, batch, kv_heads, seq, head_dim]``; ``past_key == past_value`` (and so for presents).
    - ``"static"``: a key and a value buffer of fixed length (``shape``, e.g. ``[batch, max_seq, hidden]``),
      written at ``DecoderIO.static_cache.write_indices`` along ``seq_axis`` and returned whole.

    ``kv_heads``/``head_dim`` are what it takes to build an empty past (0 where a static buffer's shape
    is all that is needed and no config states them).
    """

    layer: int
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    dtype: str
    kv_heads: int
    head_dim: int
    layout: str = "BNSH"
    shape: Shape = ()  # static layout: the buffer's shape, batch axis symbolic
    seq_axis: int = 2

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.past_key,) if self.layout == "stacked" else (self.past_key, self.past_value)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.present_key,) if self.layout == "stacked" else (self.present_key, self.present_value)

    @property
    def batch_axis(self) -> int:
        return 1 if self.layout == "stacked" else 0

    def buffer_shape(self, batch: int, length: int) -> tuple[int, ...]:
        """The shape of one of this layer's cache tensors holding ``length`` positions of ``batch`` rows
        (a static buffer's length is its own, whatever ``length`` says)."""
        if self.layout == "stacked":
            return (2, batch, self.kv_heads, length, self.head_dim)
        if self.layout == "static":
            return tuple(batch if i == 0 else int(d) for i, d in enumerate(self.shape))  # type: ignore[arg-type]
        return (batch, self.kv_heads, length, self.head_dim)


@dataclass(frozen=True)
class StaticCache:
    """The extra inputs of a static KV cache: where each row's new tokens are written
    (``write_indices``, ``[batch]``: the row's length before the forward) and how many positions of each
    row are live after it (``kv_lengths``, ``[batch]``, e.g. ``nonpad_kv_seqlen``), plus the buffers'
    fixed length."""

    write_indices: str
    kv_lengths: str | None
    length: int


@dataclass(frozen=True)
class StatePair:
    """A fixed-size recurrent state: zeros at start, replaced by ``output`` after every forward.

    ``shape`` is the per-sequence shape with the leading batch axis kept as ``"batch"``; every other
    axis is static (a state whose non-batch extent is unknown cannot be allocated and is an error).
    ``kind`` is ``"conv"``, ``"recurrent"`` or ``"state"`` (anything else), ``layer`` the layer index
    when the name carries one.
    """

    input: str
    output: str
    shape: Shape
    dtype: str
    layer: int | None = None
    kind: str = "state"


@dataclass(frozen=True)
class DecoderIO:
    """The whole I/O topology of a decoder export."""

    source: IOSource
    token_input: str
    logits: str
    attention_mask: str | None = None
    position_ids: str | None = None
    position_ids_rank: int = 2
    kv_pairs: tuple[KVPair, ...] = ()
    state_pairs: tuple[StatePair, ...] = ()
    hidden_states: tuple[str, ...] = ()
    # GroupQueryAttention exports can write present into the same max-length buffer as past.
    past_present_share_buffer: bool = False
    # Static KV caches (fixed-length buffers written at given indices); their pairs have layout "static".
    static_cache: StaticCache | None = None
    # The attention reads each row's length from the count of ones in its mask (GroupQueryAttention):
    # padded batches must be right-padded.
    lengths_from_mask: bool = False
    # The fewest positions a shared KV buffer may hold (GroupQueryAttention's local_window_size: a
    # sliding-window layer refuses a smaller buffer).
    min_kv_capacity: int = 0
    # Every other graph input, with how it is fed (unknown extra inputs are an error at derivation).
    extra_inputs: tuple[Port, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # The graph's own input and output ports (name, dtype, shape), in graph order.
    input_ports: tuple[Port, ...] = ()
    output_ports: tuple[Port, ...] = ()

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_pairs)

    @property
    def kv_in_place(self) -> bool:
        """Whether every forward writes the KV caches into the buffers it reads (a shared past/present
        buffer or a static cache): the decode state then only moves a length cursor."""
        return self.past_present_share_buffer or self.static_cache is not None

    @property
    def kv_mode(self) -> str:
        """``"static"``, ``"shared"`` or ``"growing"`` (present = past + new tokens)."""
        if self.static_cache is not None:
            return "static"
        return "shared" if self.past_present_share_buffer else "growing"

    def port(self, name: str) -> Port:
        """The graph input or output called ``name`` (``KeyError`` when the graph has none)."""
        for p in (*self.input_ports, *self.output_ports):
            if p.name == name:
                return p
        raise KeyError(name)
