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


@dataclass(frozen=True)
class KVPair:
    """Past/present key and value of one attention layer.

    ``layout`` is ``"BNSH"``: ``[batch, kv_heads, seq, head_dim]`` (the only layout in use by the export
    families onnxgen knows). ``kv_heads``/``head_dim`` are what it takes to build an empty past.
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

    @property
    def inputs(self) -> tuple[str, str]:
        return (self.past_key, self.past_value)

    @property
    def outputs(self) -> tuple[str, str]:
        return (self.present_key, self.present_value)


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
    # Every other graph input, with how it is fed (unknown extra inputs are an error at derivation).
    extra_inputs: tuple[Port, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # The graph's own input and output ports (name, dtype, shape), in graph order.
    input_ports: tuple[Port, ...] = ()
    output_ports: tuple[Port, ...] = ()

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_pairs)

    def port(self, name: str) -> Port:
        """The graph input or output called ``name`` (``KeyError`` when the graph has none)."""
        for p in (*self.input_ports, *self.output_ports):
            if p.name == name:
                return p
        raise KeyError(name)
