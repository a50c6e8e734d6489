"""KV-cache geometry (kv_heads, head_dim) when the past port's shape does not state it.

Sources, in order: the past port's static shape, the config files (genai_config ``head_size`` /
``num_key_value_heads``; config.json ``head_dim`` / ``num_key_value_heads`` / ``hidden_size`` /
``num_attention_heads``), then the attention node that consumes the past:

- ``com.microsoft::GroupQueryAttention``: ``kv_num_heads``; head_dim = width of its key input / kv heads
  (or, for packed QKV, width of its query input / (num_heads + 2·kv_heads));
- ONNX ``Attention`` (opset 23+): ``kv_num_heads`` (``q_num_heads``); head_dim from its K input.

A tensor's width (last axis) is read from ``value_info`` or from the weight that produces it
(``MatMul``/``Gemm`` initializer dims, ``MatMulNBits`` attribute ``N``), looking through
``Add``/``Cast``/``Identity``/``Mul``, norms and rotary embeddings (same shape as their input), a
``Reshape`` to a constant target with a positive last extent, and last-axis ``Split``. Weight data is never
read, only dims (and small constant shape/split vectors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx
from onnx import helper, numpy_helper

from onnxgen.model.graph_ports import MS_DOMAIN, consumers

_PASS_THROUGH = {"Add", "Cast", "Identity", "Mul"}
# Ops whose output 0 has the shape of their input 0 (norms, rotary embeddings).
_SAME_SHAPE = {
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "LayerNormalization",
    "RMSNormalization",
    "RotaryEmbedding",
    "MRotaryEmbedding",
}
_MAX_DEPTH = 8


class _GraphIndex:
    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.inits = {t.name: t for t in g.initializer}
        self.shapes: dict[str, list[int | None]] = {}
        for vi in [*g.value_info, *g.input, *g.output]:
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                self.shapes[vi.name] = [
                    d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim
                ]
        self.consumers = consumers(model)

    def _const_ints(self, name: str) -> list[int] | None:
        """Values of a small integer constant (initializer or Constant node), never external data."""
        t = self.inits.get(name)
        node = self.producer.get(name)
        if t is None and node is not None and node.op_type == "Constant":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if "value_ints" in attrs:
                return [int(v) for v in attrs["value_ints"]]
            t = attrs.get("value")
        if not isinstance(t, onnx.TensorProto) or t.data_location == onnx.TensorProto.EXTERNAL:
            return None
        return [int(v) for v in numpy_helper.to_array(t).reshape(-1)]

    def width(self, name: str, depth: int = 0) -> int | None:
        """Static extent of the last axis of value ``name``, or ``None`` when it cannot be told."""
        shape = self.shapes.get(name)
        if shape and shape[-1]:
            return shape[-1]
        node = self.producer.get(name)
        if node is None or depth > _MAX_DEPTH:
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits":
            return int(attrs["N"]) if "N" in attrs else None
        if node.op_type == "MatMul" and node.input[1] in self.inits:
            return int(self.inits[node.input[1]].dims[-1])
        if node.op_type == "Gemm" and node.input[1] in self.inits:
            dims = self.inits[node.input[1]].dims
            return int(dims[0] if attrs.get("transB", 0) else dims[-1])
        if node.op_type == "Split":
            return self._split_width(node, attrs, name)
        if node.op_type == "Reshape":
            target = self._const_ints(node.input[1]) if len(node.input) > 1 else None
            return target[-1] if target and target[-1] > 0 else None
        if node.op_type in _SAME_SHAPE and node.domain in ("", MS_DOMAIN):
            return self.width(node.input[0], depth + 1)
        if node.op_type in _PASS_THROUGH:
            for inp in node.input:
                if inp and inp not in self.inits and (w := self.width(inp, depth + 1)):
                    return w
        return None

    def _split_width(self, node: onnx.NodeProto, attrs: Mapping[str, Any], name: str) -> int | None:
        if attrs.get("axis", 0) not in (-1, 2):
            return None
        sizes = list(attrs.get("split", [])) or (
            self._const_ints(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        )
        if not sizes:
            return None
        return int(sizes[list(node.output).index(name)])


def _divide(width: int | None, parts: int) -> int | None:
    if width is None or parts <= 0 or width % parts:
        return None
    return width // parts


class AttentionGeometry:
    """(kv_heads, head_dim) read off the attention node that consumes a past key (index built once)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._index: _GraphIndex | None = None

    def __call__(self, past_key: str) -> tuple[int | None, int | None]:
        if self._index is None:
            self._index = _GraphIndex(self._model)
        index = self._index
        for node in index.consumers.get(past_key, []):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "GroupQueryAttention" and node.domain == MS_DOMAIN:
                return _gqa(index, node, attrs)
            if node.op_type == "Attention" and (node.domain or "") == "":
                kv = int(attrs.get("kv_num_heads", 0)) or None
                shape = index.shapes.get(node.input[1])
                if shape and len(shape) == 4:
                    return shape[1] or kv, shape[3]
                return kv, _divide(index.width(node.input[1]), kv or 0)
        return None, None


def _gqa(index: _GraphIndex, node: onnx.NodeProto, attrs: Mapping[str, Any]) -> tuple[int | None, int | None]:
    kv = int(attrs.get("kv_num_heads", 0)) or None
    heads = int(attrs.get("num_heads", 0))
    if kv is None:
        return None, None
    key = node.input[1] if len(node.input) > 1 else ""
    if key:
        return kv, _divide(index.width(key), kv)
    return kv, _divide(index.width(node.input[0]), heads + 2 * kv)


def _first_int(cfg: Mapping[str, Any] | None, *keys: str) -> int | None:
    if not cfg:
        return None
    for key in keys:
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def geometry_from_configs(
    genai_config: Mapping[str, Any] | None, hf_config: Mapping[str, Any] | None
) -> tuple[int | None, int | None]:
    """(kv_heads, head_dim) stated by genai_config.json's decoder section, else by config.json."""
    decoder = ((genai_config or {}).get("model") or {}).get("decoder") or {}
    kv = _first_int(decoder, "num_key_value_heads")
    hd = _first_int(decoder, "head_size")
    cfg = text_config(hf_config)
    kv = kv or _first_int(cfg, "num_key_value_heads", "num_attention_heads")
    hd = hd or _first_int(cfg, "head_dim")
    if hd is None:
        hidden, heads = _first_int(cfg, "hidden_size"), _first_int(cfg, "num_attention_heads")
        hd = _divide(hidden, heads) if hidden and heads else None
    return kv, hd


def text_config(hf_config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """config.json's language-model section: ``text_config`` for multimodal configs, else the whole file."""
    cfg = hf_config or {}
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in cfg:
        return text
    return cfg
