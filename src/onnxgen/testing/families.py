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

Variants (:class:`Variant`, any family unless said):

- ``kv="stacked"``: GPT-2 style ``past_N`` -> ``present_N`` ``[2, batch_size, kv_heads, seq, head_dim]``
  (key and value stacked on axis 0; the body gathers them apart and stacks the presents);
- ``kv="static"``: mobius ``--static-cache`` buffers ``key_cache.N`` / ``value_cache.N``
  ``[batch_size, max_position, kv_heads*head_dim]`` written with TensorScatter at ``write_indices``, read
  up to ``nonpad_kv_seqlen``; no attention mask. Families with plain or Attention-24 attention (the
  GroupQueryAttention families' static form is the shared past/present buffer they already have);
- ``index_dtype="int32"``: ``input_ids``, ``attention_mask`` and ``position_ids`` (and the static cache's
  indices) are int32 inputs, cast to int64 inside (as in onnxruntime-genai's GPT-2 test model).

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
from onnxgen.testing.graph import GraphBuilder, onnx_dtype
from onnxgen.testing.spec import TinySpec

AttentionForm = Literal["gqa", "plain", "onnx24"]
KVForm = Literal["split", "stacked", "static"]
KV_FORMS = ("split", "stacked", "static")
INDEX_DTYPES = ("int64", "int32")
StateNaming = Literal["genai", "mobius"]
LinearForm = Literal["fused", "scan", "scan-fused"]


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
    # hybrid-genai with each LinearAttention rewritten into a Scan (conv and gated norm stay fused ops)
    "hybrid-genai-scan": Style("fused", "gqa", 3, 21, "genai", states="genai", linear="scan-fused"),
}


@dataclass(frozen=True)
class Variant:
    """How the KV cache is laid out and which integer type the index inputs have (module docstring)."""

    kv: KVForm = "split"
    index_dtype: str = "int64"


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
    variant: Variant = Variant()
    # graph input -> the int64 value the body reads (a Cast of it for int32 inputs)
    body: dict[str, str] = field(default_factory=dict)
    static: att.StaticInputs | None = None  # the static cache's inputs, as the body reads them

    def read(self, name: str) -> str:
        return self.body.get(name, name)


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


def _index_input(
    b: GraphBuilder, name: str, shape: list[int | str], variant: Variant, body: dict[str, str]
) -> str:
    """An index input of the variant's type; the body reads it as int64 (through a Cast for int32)."""
    b.input(name, variant.index_dtype, shape)
    if variant.index_dtype != "int64":
        body[name] = b.op1("Cast", [name], to=onnx_dtype("int64"))
    return name


def _declare_kv(b: GraphBuilder, spec: TinySpec, layer: int, form: KVForm) -> att.KVPorts:
    kvh, hd = spec.num_kv_heads, spec.head_dim
    if form == "stacked":
        past, present = f"past_{layer}", f"present_{layer}"
        b.input(past, "float32", [2, "batch_size", kvh, "past_sequence_length", hd])
        return att.KVPorts(layer, past, past, present, present)
    if form == "static":
        ports = att.KVPorts(
            layer, f"key_cache.{layer}", f"value_cache.{layer}", f"updated_key_cache.{layer}",
            f"updated_value_cache.{layer}",
        )  # fmt: skip
        for name in (ports.past_key, ports.past_value):
            b.input(name, "float32", ["batch_size", spec.max_position, kvh * hd])
        return ports
    ports = att.KVPorts.standard(layer)
    for name in (ports.past_key, ports.past_value):
        b.input(name, "float32", ["batch_size", kvh, "past_sequence_length", hd])
    return ports


def _declare_ports(b: GraphBuilder, spec: TinySpec, style: Style, variant: Variant) -> Ports:
    """Graph inputs in exporter order; returns the port names (outputs are declared after the body)."""
    body: dict[str, str] = {}
    _index_input(b, "input_ids", ["batch_size", "sequence_length"], variant, body)
    if variant.kv != "static":
        _index_input(b, "attention_mask", ["batch_size", "total_sequence_length"], variant, body)
    position_ids = None
    if style.position_ids_rank == 2:
        position_ids = _index_input(b, "position_ids", ["batch_size", "sequence_length"], variant, body)
    elif style.position_ids_rank == 3:
        position_ids = _index_input(b, "position_ids", [3, "batch_size", "sequence_length"], variant, body)
    kv: list[att.KVPorts] = []
    states: list[StatePorts] = []
    for layer, kind in enumerate(spec.types):
        if kind == "attention":
            kv.append(_declare_kv(b, spec, layer, variant.kv))
        else:
            assert style.states is not None
            for st in _state_ports(spec, layer, style.states):
                b.input(st.input, "float32", st.shape)
                states.append(st)
    static = None
    if variant.kv == "static":
        _index_input(b, "write_indices", ["batch_size"], variant, body)
        _index_input(b, "nonpad_kv_seqlen", ["batch_size"], variant, body)
        static = att.StaticInputs(
            body.get("write_indices", "write_indices"), body.get("nonpad_kv_seqlen", "nonpad_kv_seqlen")
        )
    return Ports(position_ids, style.position_ids_rank, tuple(kv), tuple(states), variant, body, static)


def _declare_outputs(b: GraphBuilder, spec: TinySpec, style: Style, ports: Ports) -> None:
    b.output("logits", "float32", ["batch_size", "sequence_length", spec.vocab_size])
    kv = {p.layer: p for p in ports.kv}
    form = ports.variant.kv
    shape: list[int | str | None]
    for layer in range(spec.num_layers):
        if layer in kv:
            if form == "stacked":
                shape = [2, "batch_size", spec.num_kv_heads, "total_sequence_length", spec.head_dim]
                b.output(kv[layer].present_key, "float32", shape)
            elif form == "static":
                shape = ["batch_size", spec.max_position, spec.num_kv_heads * spec.head_dim]
                b.output(kv[layer].present_key, "float32", shape)
                b.output(kv[layer].present_value, "float32", shape)
            else:
                shape = ["batch_size", spec.num_kv_heads, "total_sequence_length", spec.head_dim]
                b.output(kv[layer].present_key, "float32", shape)
                b.output(kv[layer].present_value, "float32", shape)
        for st in (st for st in ports.states if st.layer == layer):
            shape = list(st.shape)
            if style.states == "mobius":  # mobius leaves present state shapes symbolic
                shape = [
                    "batch_size",
                    *(f"present_{layer}_{st.kind}_state_dim_{i}" for i in range(1, len(shape))),
                ]
            b.output(st.output, "float32", shape)


def _mixer(d: Decoder, style: Style, ports: Ports) -> Mixer:
    """The per-layer token mixer closure for ``style`` (shared mask/length subgraphs built once)."""
    from onnxgen.testing import linear  # colleague-owned; imported lazily so dense families never need it

    kv = {p.layer: p for p in ports.kv}
    states = {(st.layer, st.kind): st for st in ports.states}
    ids, mask = ports.read("input_ids"), ports.read("attention_mask")
    positions = ports.read(ports.position_ids) if ports.position_ids else None
    static = ports.static
    lengths = att.gqa_lengths(d, mask) if style.attention == "gqa" and kv else None
    bias = None
    if static is not None and style.attention == "plain" and kv:
        bias = att.static_bias(d, ids, static)
    elif static is None and style.attention != "gqa" and kv:
        bias = att.causal_bias(d, mask, ids)
    rows = positions if style.position_ids_rank == 3 else None

    def attend(layer: int, x: str, ports_: att.KVPorts) -> str:
        if lengths is not None:
            return att.attention_gqa(d, x, layer, ports_, lengths, rows)
        assert positions is not None
        if static is not None:
            return att.attention_static(d, x, layer, ports_, positions, static, bias)
        assert bias is not None
        form = att.attention_plain if style.attention == "plain" else att.attention_onnx24
        return form(d, x, layer, ports_, positions, bias)

    def mix(layer: int, x: str) -> str:
        if layer in kv:
            if ports.variant.kv != "stacked":
                return attend(layer, x, kv[layer])
            split = att.unstack_kv(d, kv[layer])
            out = attend(layer, x, split)
            att.restack_kv(d, split, kv[layer].present_key)
            return out
        conv, rec = states[(layer, "conv")], states[(layer, "recurrent")]
        names = (conv.input, rec.input, conv.output, rec.output)
        if style.linear == "fused":
            return linear.linear_layer_fused(d.b, x, d.w, d.spec, layer, *names)
        return linear.linear_layer_scan(
            d.b, x, d.w, d.spec, layer, *names, fused_ops=style.linear == "scan-fused"
        )

    return mix


def build_graph(
    family: str,
    spec: TinySpec,
    weights: dict[str, np.ndarray],
    precision: Precision,
    variant: Variant = Variant(),
) -> tuple[onnx.ModelProto, Ports]:
    """The ONNX model of ``family`` (in ``variant``) for ``spec`` and its port names."""
    style = STYLES[family]
    b = GraphBuilder(name=f"tiny_{family.replace('-', '_')}")
    d = Decoder(b, spec, weights, norms=style.norms, precision=precision)
    ports = _declare_ports(b, spec, style, variant)
    decoder_stack(d, ports.read("input_ids"), _mixer(d, style, ports))
    _declare_outputs(b, spec, style, ports)
    ms_opset = None if style.plain_onnx and precision == "fp32" else 1
    opset = max(style.opset, 24) if variant.kv == "static" else style.opset  # TensorScatter is opset 24
    return b.model(opset=opset, ms_opset=ms_opset), ports
