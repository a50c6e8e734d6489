"""The export families: one tiny decoder written the way each exporter writes it.

=============== ==================================== ================= ================================= ============== =======
family          attention                            position_ids      linear-layer states               norms          opset
=============== ==================================== ================= ================================= ============== =======
genai-dense     GroupQueryAttention, fused rotary    none              —                                 SkipSimplified 21 + ms
standard-dense  plain ops, Concat-grown cache        [B, S]            —                                 plain ops      21
hybrid-genai    MRotaryEmbedding + GQA (do_rotary=0) [3, B, S] mRoPE  ``past.N.conv``/``.recurrent``     SkipSimplified 21 + ms
hybrid-mobius   RotaryEmbedding-23 + Attention-24    [B, S]            ``past_key_values.N.conv_state``  RMSNorm-23     24 + ms
hybrid-scan     RotaryEmbedding-23 + Attention-24    [B, S]            same names; Scan over the tokens  RMSNorm-23     24
=============== ==================================== ================= ================================= ============== =======

Every family reads the same weights (:func:`onnxgen.testing.spec.make_weights`), so one spec gives one
function in all of them. KV ports are ``past_key_values.N.key/value`` -> ``present.N.key/value`` with N the
absolute layer index, ``[batch_size, kv_heads, past_sequence_length, head_dim]``.

Padding: plain and Attention-24 attention honour any padding in ``attention_mask``; GroupQueryAttention
reads only the number of ones in each mask row, so batches for the genai families must be right-padded
(the real builder's contract). Linear layers take no mask: pad tokens would enter their state, so hybrid
batches are meant to hold sequences of equal length (or to be prefilled one sequence at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx

from onnxgen.testing import attention as att
from onnxgen.testing.dense import Decoder, Mixer, Norms, Precision, decoder_stack
from onnxgen.testing.graph import GraphBuilder
from onnxgen.testing.spec import TinySpec

AttentionForm = Literal["gqa", "plain", "onnx24"]
StateNaming = Literal["genai", "mobius"]
LinearForm = Literal["fused", "scan"]


@dataclass(frozen=True)
class Style:
    """How one exporter writes the decoder."""

    norms: Norms
    attention: AttentionForm
    position_ids_rank: int  # 0 = no position_ids input
    opset: int
    default_config: str
    states: StateNaming | None = None
    linear: LinearForm | None = None
    plain_onnx: bool = False  # only standard ONNX ops (no com.microsoft, so no int4)

    @property
    def hybrid(self) -> bool:
        return self.linear is not None


STYLES: dict[str, Style] = {
    "genai-dense": Style("fused", "gqa", 0, 21, "genai"),
    "standard-dense": Style("plain", "plain", 2, 21, "none", plain_onnx=True),
    "hybrid-genai": Style("fused", "gqa", 3, 21, "genai", states="genai", linear="fused"),
    "hybrid-mobius": Style("rms_op", "onnx24", 2, 24, "metadata", states="mobius", linear="fused"),
    "hybrid-scan": Style(
        "rms_op", "onnx24", 2, 24, "metadata", states="mobius", linear="scan", plain_onnx=True
    ),
}


@dataclass(frozen=True)
class StatePorts:
    """One recurrent state of a linear layer: past input, present output, per-sequence shape and kind."""

    input: str
    output: str
    shape: tuple[int | str, ...]
    kind: str  # "conv" | "recurrent"
    layer: int


@dataclass(frozen=True)
class Ports:
    """The graph's I/O, for the config writers."""

    position_ids: str | None
    position_ids_rank: int
    kv: tuple[att.KVPorts, ...]
    states: tuple[StatePorts, ...] = field(default=())


def _state_ports(spec: TinySpec, layer: int, naming: StateNaming) -> tuple[StatePorts, StatePorts]:
    conv_shape = ("batch_size", spec.conv_dim, spec.conv_kernel - 1)
    rec_shape = ("batch_size", spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim)
    if naming == "genai":
        names = [(f"past.{layer}.{k}", f"present.{layer}.{k}") for k in ("conv", "recurrent")]
    else:
        names = [
            (f"past_key_values.{layer}.{k}_state", f"present.{layer}.{k}_state")
            for k in ("conv", "recurrent")
        ]
    return (
        StatePorts(*names[0], conv_shape, "conv", layer),
        StatePorts(*names[1], rec_shape, "recurrent", layer),
    )


def _declare_ports(b: GraphBuilder, spec: TinySpec, style: Style) -> Ports:
    """Graph inputs in exporter order; returns the port names (outputs are declared after the body)."""
    b.input("input_ids", "int64", ["batch_size", "sequence_length"])
    b.input("attention_mask", "int64", ["batch_size", "total_sequence_length"])
    position_ids = None
    if style.position_ids_rank == 2:
        position_ids = b.input("position_ids", "int64", ["batch_size", "sequence_length"])
    elif style.position_ids_rank == 3:
        position_ids = b.input("position_ids", "int64", [3, "batch_size", "sequence_length"])
    kv: list[att.KVPorts] = []
    states: list[StatePorts] = []
    for layer, kind in enumerate(spec.types):
        if kind == "attention":
            ports = att.KVPorts.standard(layer)
            kv_shape = ["batch_size", spec.num_kv_heads, "past_sequence_length", spec.head_dim]
            b.input(ports.past_key, "float32", kv_shape)
            b.input(ports.past_value, "float32", kv_shape)
            kv.append(ports)
        else:
            assert style.states is not None
            for st in _state_ports(spec, layer, style.states):
                b.input(st.input, "float32", st.shape)
                states.append(st)
    return Ports(position_ids, style.position_ids_rank, tuple(kv), tuple(states))


def _declare_outputs(b: GraphBuilder, spec: TinySpec, style: Style, ports: Ports) -> None:
    b.output("logits", "float32", ["batch_size", "sequence_length", spec.vocab_size])
    kv = {p.layer: p for p in ports.kv}
    for layer in range(spec.num_layers):
        if layer in kv:
            shape = ["batch_size", spec.num_kv_heads, "total_sequence_length", spec.head_dim]
            b.output(kv[layer].present_key, "float32", shape)
            b.output(kv[layer].present_value, "float32", shape)
        for st in (st for st in ports.states if st.layer == layer):
            shape = list(st.shape)
            if style.states == "mobius":  # mobius leaves present state shapes symbolic
                shape = ["batch_size"] + [
                    f"present_{layer}_{st.kind}_state_dim_{i}" for i in range(1, len(shape))
                ]
            b.output(st.output, "float32", shape)


def _mixer(d: Decoder, style: Style, ports: Ports) -> Mixer:
    """The per-layer token mixer closure for ``style`` (shared mask/length subgraphs built once)."""
    from onnxgen.testing import linear  # colleague-owned; imported lazily so dense families never need it

    kv = {p.layer: p for p in ports.kv}
    states = {(st.layer, st.kind): st for st in ports.states}
    lengths = att.gqa_lengths(d, "attention_mask") if style.attention == "gqa" and kv else None
    bias = att.causal_bias(d, "attention_mask", "input_ids") if style.attention != "gqa" and kv else None
    rows = ports.position_ids if style.position_ids_rank == 3 else None

    def mix(layer: int, x: str) -> str:
        if layer in kv:
            if lengths is not None:
                return att.attention_gqa(d, x, layer, kv[layer], lengths, rows)
            assert bias is not None and ports.position_ids is not None
            form = att.attention_plain if style.attention == "plain" else att.attention_onnx24
            return form(d, x, layer, kv[layer], ports.position_ids, bias)
        conv, rec = states[(layer, "conv")], states[(layer, "recurrent")]
        fn = linear.linear_layer_scan if style.linear == "scan" else linear.linear_layer_fused
        return fn(d.b, x, d.w, d.spec, layer, conv.input, rec.input, conv.output, rec.output)

    return mix


def build_graph(
    family: str, spec: TinySpec, weights: dict[str, np.ndarray], precision: Precision
) -> tuple[onnx.ModelProto, Ports]:
    """The ONNX model of ``family`` for ``spec`` and its port names."""
    style = STYLES[family]
    b = GraphBuilder(name=f"tiny_{family.replace('-', '_')}")
    d = Decoder(b, spec, weights, norms=style.norms, precision=precision)
    ports = _declare_ports(b, spec, style)
    decoder_stack(d, "input_ids", _mixer(d, style, ports))
    _declare_outputs(b, spec, style, ports)
    ms_opset = None if style.plain_onnx and precision == "fp32" else 1
    return b.model(opset=style.opset, ms_opset=ms_opset), ports
