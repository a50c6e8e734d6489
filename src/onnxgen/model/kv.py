"""KV pairs: checking the ports of each attention layer's cache and finding (kv_heads, head_dim).

Layouts (:class:`onnxgen.model.io.KVPair`): ``BNSH`` key and value ports ``[batch, kv_heads, seq, head_dim]``;
``stacked`` one ``[2, batch, kv_heads, seq, head_dim]`` port per layer; ``static`` fixed-length buffers whose
sequence axis is the ``axis`` of the ``TensorScatter`` that writes them (ONNX's default, -2, without one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx

from onnxgen.errors import DecoderIOError
from onnxgen.model.geometry import AttentionGeometry, geometry_from_configs
from onnxgen.model.graph_ports import MS_DOMAIN, GraphSignature, consumers
from onnxgen.model.io import KVPair, Port
from onnxgen.model.naming import KVNames
from onnxgen.model.pairs import check_compatible


def _static(port: Port, axis: int) -> int | None:
    if port.rank_known and port.rank > axis and isinstance(port.shape[axis], int):
        return int(port.shape[axis])  # type: ignore[arg-type]
    return None


class KVBuilder:
    """Builds checked :class:`KVPair` objects; geometry from shapes, then configs, then the graph."""

    def __init__(
        self,
        model: onnx.ModelProto,
        sig: GraphSignature,
        genai_config: Mapping[str, Any] | None,
        hf_config: Mapping[str, Any] | None,
    ) -> None:
        self.sig = sig
        self.config_kv, self.config_hd = geometry_from_configs(genai_config, hf_config)
        self.attention = AttentionGeometry(model)
        self.users = consumers(model)
        self.notes: list[str] = []

    def build(self, names: KVNames) -> KVPair:
        pk, pv = self.sig.input(names.past_key), self.sig.input(names.past_value)
        prk, prv = self.sig.output(names.present_key), self.sig.output(names.present_value)
        if pk is None or pv is None or prk is None or prv is None:  # stated names are checked earlier
            raise DecoderIOError(f"layer {names.layer} KV ports {names} are not all in the graph")
        if names.layout == "stacked":
            return self._stacked(names, pk, prk)
        if names.layout == "static":
            return self._static(names, pk, pv, prk, prv)
        for past in (pk, pv):
            if past.rank_known and past.rank != 4:
                raise DecoderIOError(
                    f"KV input '{past.name}' has rank {past.rank}; onnxgen supports [batch, kv_heads, seq, head_dim] caches"
                )
        check_compatible(pk, prk, seq_axis=2)
        check_compatible(pv, prv, seq_axis=2)
        if pk.dtype != pv.dtype:
            raise DecoderIOError(
                f"KV inputs '{pk.name}' ({pk.dtype}) and '{pv.name}' ({pv.dtype}) differ in dtype"
            )
        kv_heads, head_dim = self._geometry(pk, pv, prk)
        return KVPair(
            names.layer, pk.name, pv.name, prk.name, prv.name, pk.dtype, kv_heads=kv_heads, head_dim=head_dim
        )

    def _stacked(self, names: KVNames, past: Port, present: Port) -> KVPair:
        if past.rank_known and past.rank != 5:
            raise DecoderIOError(
                f"stacked KV input '{past.name}' has rank {past.rank}; onnxgen supports stacked caches of shape "
                "[2, batch, kv_heads, seq, head_dim]"
            )
        check_compatible(past, present, seq_axis=3)
        kv, hd = self._geometry(past, past, present, axes=(2, 4))
        return KVPair(
            names.layer, past.name, past.name, present.name, present.name, past.dtype, kv, hd, layout="stacked",
            seq_axis=3,
        )  # fmt: skip

    def _static(self, names: KVNames, pk: Port, pv: Port, prk: Port, prv: Port) -> KVPair:
        for past, present in ((pk, prk), (pv, prv)):
            check_compatible(past, present)
            if not past.rank_known or past.rank < 2 or not all(isinstance(d, int) for d in past.shape[1:]):
                raise DecoderIOError(
                    f"static cache input '{past.name}' has shape {list(past.shape)}; a static cache needs fixed "
                    "extents on every axis but the batch"
                )
        if pk.shape != pv.shape or pk.dtype != pv.dtype:
            raise DecoderIOError(
                f"static caches '{pk.name}' {list(pk.shape)} {pk.dtype} and '{pv.name}' {list(pv.shape)} "
                f"{pv.dtype} differ; onnxgen needs key and value buffers of one shape and dtype"
            )
        axis = self._scatter_axis(pk)
        if not 0 < axis < pk.rank:
            raise DecoderIOError(
                f"static cache '{pk.name}' is written along axis {axis}, which is not a sequence axis of "
                f"{list(pk.shape)}"
            )
        kv = self.config_kv or 0
        hd = self.config_hd or 0
        return KVPair(
            names.layer, pk.name, pv.name, prk.name, prv.name, pk.dtype, kv, hd, layout="static",
            shape=("batch", *pk.shape[1:]), seq_axis=axis,
        )  # fmt: skip

    def _scatter_axis(self, past: Port) -> int:
        """The ``axis`` of the TensorScatter nodes reading ``past`` (ONNX's default -2), made positive."""
        axes = set()
        for node in self.users.get(past.name, []):
            if node.op_type == "TensorScatter" and node.domain in ("", "ai.onnx"):
                axis = next((a.i for a in node.attribute if a.name == "axis"), -2)
                axes.add(axis + past.rank if axis < 0 else axis)
        if len(axes) > 1:
            raise DecoderIOError(f"static cache '{past.name}' is written along several axes {sorted(axes)}")
        return axes.pop() if axes else past.rank - 2

    def _geometry(self, pk: Port, pv: Port, prk: Port, axes: tuple[int, int] = (1, 3)) -> tuple[int, int]:
        kv = _static(pk, axes[0]) or _static(prk, axes[0]) or _static(pv, axes[0])
        hd = _static(pk, axes[1]) or _static(prk, axes[1])
        for what, graph_value, config_value in (
            ("kv_heads", kv, self.config_kv),
            ("head_dim", hd, self.config_hd),
        ):
            if graph_value and config_value and graph_value != config_value:
                note = f"{what}: graph port '{pk.name}' says {graph_value}, config says {config_value}; using the graph"
                if note not in self.notes:
                    self.notes.append(note)
        kv, hd = kv or self.config_kv, hd or self.config_hd
        if kv is None or hd is None:
            node_kv, node_hd = self.attention(pk.name)
            kv, hd = kv or node_kv, hd or node_hd
        if kv is None or hd is None:
            missing = " and ".join(w for w, v in (("kv_heads", kv), ("head_dim", hd)) if v is None)
            raise DecoderIOError(
                f"cannot tell {missing} of KV input '{pk.name}' (shape {list(pk.shape)}): no static extent, no config "
                "states it and no attention node reveals it; add num_key_value_heads/head_dim to config.json or "
                "declare the shape in inference_metadata.yaml model.io kv_inputs ({name, shape})"
            )
        return kv, hd


def shares_buffer(model: onnx.ModelProto, pairs: list[KVPair]) -> bool:
    """Every past key/value is read only by com.microsoft GroupQueryAttention nodes."""
    if not pairs:
        return False
    users = consumers(model)
    for pair in pairs:
        for name in pair.inputs:
            nodes = users.get(name, [])
            if not nodes or any(n.op_type != "GroupQueryAttention" or n.domain != MS_DOMAIN for n in nodes):
                return False
    return True


def reads_lengths_from_mask(model: onnx.ModelProto, pairs: list[KVPair]) -> bool:
    """Some past key/value reaches a com.microsoft GroupQueryAttention node (directly, or through the
    Gather that splits a stacked cache): that op takes each row's length from its mask's count of ones."""
    users = consumers(model)
    for pair in pairs:
        for name in pair.inputs:
            nodes = list(users.get(name, []))
            nodes += [
                u for n in nodes if n.op_type == "Gather" for out in n.output for u in users.get(out, [])
            ]
            if any(n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN for n in nodes):
                return True
    return False


def sliding_window(model: onnx.ModelProto) -> int:
    """The largest ``local_window_size`` of the graph's GroupQueryAttention nodes (0: none has one)."""
    sizes = [
        a.i
        for n in model.graph.node
        if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN
        for a in n.attribute
        if a.name == "local_window_size"
    ]
    return max([0, *sizes])
