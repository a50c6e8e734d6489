"""The exact port lists of real onnxruntime-genai 0.18 builder exports (docs/export-families.md):
symbolic ``kv_cache_dim`` head_dim, sparse KV layers, ``past.N.conv``/``past.N.recurrent`` states and
rank-3 mRoPE position ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from sigbuild import PortSpec, sig_model, write_package

from onnxgen.errors import DecoderIOError
from onnxgen.model import DecoderIO, ModelPackage

B, S, T, P, HD = (
    "batch_size",
    "sequence_length",
    "total_sequence_length",
    "past_sequence_length",
    "kv_cache_dim",
)


def _kv(layers: list[int]) -> tuple[list[PortSpec], list[PortSpec]]:
    ins = [(f"past_key_values.{i}.{k}", "float32", [B, 2, P, HD]) for k in ("key", "value") for i in layers]
    outs = [(f"present.{i}.{k}", "float32", [B, 2, T, HD]) for k in ("key", "value") for i in layers]
    return ins, outs


def _qwen3_tiny() -> tuple[list[PortSpec], list[PortSpec]]:
    kin, kout = _kv([0, 1, 2, 3])
    ins = [("input_ids", "int64", [B, S]), ("attention_mask", "int64", [B, T]), *kin]
    return ins, [("logits", "float32", [B, S, 512]), *kout]


def _qwen35_tiny() -> tuple[list[PortSpec], list[PortSpec]]:
    kin, kout = _kv([3])
    ins: list[PortSpec] = [("input_ids", "int64", [B, S]), ("attention_mask", "int64", [B, T])]
    ins += [("position_ids", "int64", [3, B, S]), *kin]
    ins += [(f"past.{i}.conv", "float32", [B, 192, 3]) for i in range(3)]
    ins += [(f"past.{i}.recurrent", "float32", [B, 4, 16, 32]) for i in range(3)]
    outs: list[PortSpec] = [("logits", "float32", [B, S, 512]), *kout]
    outs += [(f"present.{i}.conv", "float32", [B, 192, 3]) for i in range(3)]
    outs += [(f"present.{i}.recurrent", "float32", [B, 4, 16, 32]) for i in range(3)]
    return ins, outs


def _genai(hybrid: bool) -> dict[str, object]:
    ins = {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    outs = {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    if hybrid:
        ins |= {
            "position_ids": "position_ids",
            "past_conv_names": "past.%d.conv",
            "past_recurrent_names": "past.%d.recurrent",
        }
        outs |= {"present_conv_names": "present.%d.conv", "present_recurrent_names": "present.%d.recurrent"}
    decoder = {"head_size": 32, "hidden_size": 64, "inputs": ins, "outputs": outs, "num_attention_heads": 4}
    decoder |= {"num_hidden_layers": 4, "num_key_value_heads": 2, "filename": "model.onnx"}
    model = {
        "bos_token_id": 1,
        "context_length": 512,
        "decoder": decoder,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    return {"model": model, "search": {"max_length": 512, "past_present_share_buffer": True}}


def _open(tmp_path: Path, model: onnx.ModelProto, files: dict[str, object]) -> ModelPackage:
    return ModelPackage.open(write_package(tmp_path, model, files))


def test_real_qwen3_export_takes_head_dim_from_genai_head_size(tmp_path: Path) -> None:
    pkg = _open(tmp_path, sig_model(*_qwen3_tiny()), {"genai_config.json": _genai(False)})
    io = pkg.io
    assert io.source == "genai_config"
    assert io.position_ids is None
    assert [p.layer for p in io.kv_pairs] == [0, 1, 2, 3]
    assert {(p.kv_heads, p.head_dim) for p in io.kv_pairs} == {(2, 32)}
    assert (pkg.eos_token_ids, pkg.bos_token_id, pkg.pad_token_id, pkg.context_length) == ((0,), 1, 0, 512)


def _check_qwen35(io: DecoderIO) -> None:
    assert [(p.layer, p.kv_heads, p.head_dim) for p in io.kv_pairs] == [(3, 2, 32)]
    assert [(s.layer, s.kind) for s in io.state_pairs] == [
        (i, k) for i in range(3) for k in ("conv", "recurrent")
    ]
    assert {s.shape for s in io.state_pairs if s.kind == "conv"} == {("batch", 192, 3)}
    assert {s.shape for s in io.state_pairs if s.kind == "recurrent"} == {("batch", 4, 16, 32)}
    assert (io.position_ids, io.position_ids_rank) == ("position_ids", 3)


def test_real_qwen35_export_derives_sparse_kv_and_six_states_from_genai_templates(tmp_path: Path) -> None:
    io = _open(tmp_path, sig_model(*_qwen35_tiny()), {"genai_config.json": _genai(True)}).io
    assert io.source == "genai_config"
    _check_qwen35(io)


def test_real_qwen35_ports_without_any_config_cannot_size_the_kv_cache(tmp_path: Path) -> None:
    # kv_cache_dim is symbolic and nothing else states head_dim: a clear error, not a guess
    with pytest.raises(DecoderIOError, match=r"cannot tell head_dim of KV input 'past_key_values\.3\.key'"):
        _ = _open(tmp_path, sig_model(*_qwen35_tiny()), {}).io


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name)
    )


def test_real_qwen3_attention_chain_reveals_head_dim_without_value_info(tmp_path: Path) -> None:
    """qkv_proj MatMul -> Split -> k: Reshape [0,-1,hd] -> SimplifiedLayerNormalization -> Reshape [0,-1,kv*hd]
    -> GroupQueryAttention (the builder's Qwen3 q/k-norm chain), no config and no value_info."""
    ins, outs = _qwen3_tiny()
    nodes: list[onnx.NodeProto] = [
        helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "qkv_w"], ["qkv"]),
        _const("split_sizes", [128, 64, 64]),
        helper.make_node("Split", ["qkv", "split_sizes"], ["q", "k", "v"], axis=-1),
        _const("per_head", [0, -1, 32]),
        _const("back", [0, -1, 64]),
        helper.make_node("Reshape", ["k", "per_head"], ["k_heads"]),
        helper.make_node("SimplifiedLayerNormalization", ["k_heads", "k_norm_w"], ["k_normed"], axis=-1),
        helper.make_node("Reshape", ["k_normed", "back"], ["k_flat"]),
    ]
    for i in range(4):
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    "q",
                    "k_flat",
                    "v",
                    f"past_key_values.{i}.key",
                    f"past_key_values.{i}.value",
                    "seqlens_k",
                    "total",
                ],
                [f"attn_{i}", f"present.{i}.key", f"present.{i}.value"],
                domain="com.microsoft",
                num_heads=4,
                kv_num_heads=2,
                do_rotary=1,
            )
        )
    inits = [
        numpy_helper.from_array(np.zeros((512, 64), np.float32), "embed"),
        numpy_helper.from_array(np.zeros((64, 256), np.float32), "qkv_w"),
        numpy_helper.from_array(np.ones(32, np.float32), "k_norm_w"),
    ]
    io = _open(tmp_path, sig_model(ins, outs, nodes, inits), {}).io
    assert {(p.kv_heads, p.head_dim) for p in io.kv_pairs} == {(2, 32)}
    assert io.past_present_share_buffer is True
