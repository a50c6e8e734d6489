"""Signature-only decoder graphs for the model/I-O tests: real port names and shapes, trivial bodies.

Every output is a ``Cast`` of the first input, so the graph is valid ONNX (``onnx.checker`` passes)
while carrying exactly the ports a real export has.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
import yaml
from onnx import helper

from onnxgen.testing.graph import onnx_dtype

Dim = int | str | None
PortSpec = tuple[str, str, Sequence[Dim] | None]


def sig_model(
    inputs: Sequence[PortSpec],
    outputs: Sequence[PortSpec],
    nodes: Sequence[onnx.NodeProto] = (),
    initializers: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    """A model with exactly these ports; outputs not produced by ``nodes`` are Casts of input 0."""
    ins = [
        helper.make_tensor_value_info(n, onnx_dtype(d), None if s is None else list(s)) for n, d, s in inputs
    ]
    outs = [
        helper.make_tensor_value_info(n, onnx_dtype(d), None if s is None else list(s)) for n, d, s in outputs
    ]
    produced = {o for node in nodes for o in node.output}
    body = list(nodes)
    for name, dtype, _ in outputs:
        if name not in produced:
            body.append(helper.make_node("Cast", [inputs[0][0]], [name], to=onnx_dtype(dtype)))
    graph = helper.make_graph(body, "sig", ins, outs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="onnxgen.tests")
    model.ir_version = 10
    return model


def write_package(directory: Path, model: onnx.ModelProto | None, files: Mapping[str, object] = {}) -> Path:
    """Write ``model.onnx`` (unless ``model`` is None) and config files: a mapping is dumped as JSON or
    YAML by suffix, a string is written verbatim."""
    directory.mkdir(parents=True, exist_ok=True)
    if model is not None:
        onnx.save_model(model, str(directory / "model.onnx"))
    for name, content in files.items():
        path = directory / name
        if isinstance(content, str):
            path.write_text(content)
        elif name.endswith((".yaml", ".yml")):
            path.write_text(yaml.safe_dump(content))
        else:
            path.write_text(json.dumps(content))
    return directory


def base_inputs(position_rank: int | None = 2, mask: bool = True) -> list[PortSpec]:
    ports: list[PortSpec] = [("input_ids", "int64", ["batch", "seq"])]
    if mask:
        ports.append(("attention_mask", "int64", ["batch", "total"]))
    if position_rank == 2:
        ports.append(("position_ids", "int64", ["batch", "seq"]))
    elif position_rank == 3:
        ports.append(("position_ids", "int64", [3, "batch", "seq"]))
    return ports


def kv_ports(
    layers: Sequence[int],
    kv_heads: Dim,
    head_dim: Dim,
    *,
    past: str = "past_key_values",
    present: str = "present",
    dtype: str = "float32",
) -> tuple[list[PortSpec], list[PortSpec]]:
    ins: list[PortSpec] = []
    outs: list[PortSpec] = []
    for i in layers:
        for kind in ("key", "value"):
            ins.append((f"{past}.{i}.{kind}", dtype, ["batch", kv_heads, "past", head_dim]))
            outs.append((f"{present}.{i}.{kind}", dtype, ["batch", kv_heads, "total", head_dim]))
    return ins, outs


def logits_port(vocab: int = 320) -> PortSpec:
    return ("logits", "float32", ["batch", "seq", vocab])


def qwen3_dense(layers: int = 28) -> onnx.ModelProto:
    """Qwen3 dense layout: [batch, 8, past, 128] KV at every layer, no state."""
    kin, kout = kv_ports(range(layers), 8, 128)
    return sig_model([*base_inputs(), *kin], [logits_port(151936), *kout])


def qwen36_27b() -> onnx.ModelProto:
    """Qwen3.6-27B signature: 64 layers; full attention at 3, 7, ..., 63 with [batch, 4, past, 256] KV;
    linear layers carry conv_state [batch, 10240, 3] and recurrent_state [batch, 48, 128, 128], whose
    presents are fully symbolic."""
    attn = [i for i in range(64) if i % 4 == 3]
    kin, kout = kv_ports(attn, 4, 256)
    sin: list[PortSpec] = []
    sout: list[PortSpec] = []
    for i in (i for i in range(64) if i % 4 != 3):
        sin.append((f"past_key_values.{i}.conv_state", "float32", ["batch", 10240, 3]))
        sin.append((f"past_key_values.{i}.recurrent_state", "float32", ["batch", 48, 128, 128]))
        sout.append((f"present.{i}.conv_state", "float32", ["batch", "c1", "c2"]))
        sout.append((f"present.{i}.recurrent_state", "float32", ["batch", "r1", "r2", "r3"]))
    return sig_model([*base_inputs(position_rank=3), *kin, *sin], [logits_port(248320), *kout, *sout])
