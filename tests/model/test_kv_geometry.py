"""KV geometry when the past shape is symbolic (configs, GroupQueryAttention, Attention-24), and
whether past and present may share one buffer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from sigbuild import base_inputs, kv_ports, logits_port, sig_model, write_package

from onnxgen.errors import DecoderIOError
from onnxgen.model import DecoderIO, ModelPackage

HIDDEN, HEADS, KV, HD = 8, 4, 2, 4


def _w(name: str, cols: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros((HIDDEN, cols), np.float32), name)


def _symbolic_kv() -> tuple[list, list]:
    return kv_ports([0], "kv_heads", "head_dim")


def _gqa_model(packed: bool = False) -> onnx.ModelProto:
    kin, kout = _symbolic_kv()
    embed = numpy_helper.from_array(np.zeros((320, HIDDEN), np.float32), "embed")
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["x"])]
    inits = [embed]
    if packed:
        nodes.append(helper.make_node("MatMul", ["x", "qkv_w"], ["qkv"]))
        inits.append(_w("qkv_w", (HEADS + 2 * KV) * HD))
        qkv = ["qkv", "", ""]
    else:
        for n, cols in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD)):
            nodes.append(helper.make_node("MatMul", ["x", f"{n}_w"], [f"{n}_mm"]))
            nodes.append(helper.make_node("Add", [f"{n}_mm", f"{n}_b"], [n]))
            inits += [_w(f"{n}_w", cols), numpy_helper.from_array(np.zeros(cols, np.float32), f"{n}_b")]
        qkv = ["q", "k", "v"]
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [*qkv, "past_key_values.0.key", "past_key_values.0.value", "seqlens_k", "total_len"],
            ["attn", "present.0.key", "present.0.value"],
            domain="com.microsoft",
            num_heads=HEADS,
            kv_num_heads=KV,
        )
    )
    return sig_model([*base_inputs(None), *kin], [logits_port(), *kout], nodes, inits)


def _attention24_model() -> onnx.ModelProto:
    kin, kout = _symbolic_kv()
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "q_w"], ["q"]),
        helper.make_node("MatMul", ["x", "k_w"], ["k"]),
        helper.make_node("MatMul", ["x", "v_w"], ["v"]),
        helper.make_node(
            "Attention",
            ["q", "k", "v", "", "past_key_values.0.key", "past_key_values.0.value"],
            ["attn", "present.0.key", "present.0.value"],
            q_num_heads=HEADS,
            kv_num_heads=KV,
        ),
    ]
    inits = [numpy_helper.from_array(np.zeros((320, HIDDEN), np.float32), "embed")]
    inits += [_w("q_w", HEADS * HD), _w("k_w", KV * HD), _w("v_w", KV * HD)]
    return sig_model([*base_inputs(), *kin], [logits_port(), *kout], nodes, inits)


def _io(tmp_path: Path, model: onnx.ModelProto, files: dict[str, object] | None = None) -> DecoderIO:
    return ModelPackage.open(write_package(tmp_path, model, files or {})).io


@pytest.mark.parametrize("packed", [False, True])
def test_group_query_attention_reveals_kv_heads_and_head_dim(tmp_path: Path, packed: bool) -> None:
    pair = _io(tmp_path, _gqa_model(packed)).kv_pairs[0]
    assert (pair.kv_heads, pair.head_dim) == (KV, HD)


def test_onnx_attention_24_reveals_kv_heads_and_head_dim(tmp_path: Path) -> None:
    pair = _io(tmp_path, _attention24_model()).kv_pairs[0]
    assert (pair.kv_heads, pair.head_dim) == (KV, HD)


def test_genai_config_geometry_is_used_for_a_symbolic_past(tmp_path: Path) -> None:
    kin, kout = _symbolic_kv()
    model = sig_model([*base_inputs(), *kin], [logits_port(), *kout])
    cfg = {"model": {"decoder": {"head_size": 64, "num_key_value_heads": 3}}}
    pair = _io(tmp_path, model, {"genai_config.json": cfg}).kv_pairs[0]
    assert (pair.kv_heads, pair.head_dim) == (3, 64)


def test_config_json_geometry_falls_back_to_hidden_over_heads(tmp_path: Path) -> None:
    kin, kout = _symbolic_kv()
    model = sig_model([*base_inputs(), *kin], [logits_port(), *kout])
    cfg = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}
    pair = _io(tmp_path, model, {"config.json": cfg}).kv_pairs[0]
    assert (pair.kv_heads, pair.head_dim) == (2, 16)


def test_static_past_shape_beats_config_and_the_disagreement_is_noted(tmp_path: Path) -> None:
    kin, kout = kv_ports([0], 2, 16)
    model = sig_model([*base_inputs(), *kin], [logits_port(), *kout])
    io = _io(tmp_path, model, {"config.json": {"num_key_value_heads": 4, "head_dim": 16}})
    assert (io.kv_pairs[0].kv_heads, io.kv_pairs[0].head_dim) == (2, 16)
    assert any("kv_heads" in n and "2" in n and "4" in n for n in io.notes)


def test_unknowable_kv_geometry_is_a_clear_error(tmp_path: Path) -> None:
    kin, kout = _symbolic_kv()
    model = sig_model([*base_inputs(), *kin], [logits_port(), *kout])
    with pytest.raises(
        DecoderIOError, match=r"cannot tell kv_heads and head_dim of KV input 'past_key_values\.0\.key'"
    ):
        _io(tmp_path, model)


def test_past_read_only_by_group_query_attention_can_share_the_present_buffer(tmp_path: Path) -> None:
    assert _io(tmp_path, _gqa_model()).past_present_share_buffer is True


def test_genai_share_buffer_false_is_honoured(tmp_path: Path) -> None:
    cfg = {"search": {"past_present_share_buffer": False}}
    io = _io(tmp_path, _gqa_model(), {"genai_config.json": cfg})
    assert io.past_present_share_buffer is False
    assert any("past_present_share_buffer is false" in n for n in io.notes)


def test_genai_share_buffer_true_over_a_non_gqa_graph_is_ignored(tmp_path: Path) -> None:
    io = _io(
        tmp_path, _attention24_model(), {"genai_config.json": {"search": {"past_present_share_buffer": True}}}
    )
    assert io.past_present_share_buffer is False
    assert any("not every past key/value feeds a GroupQueryAttention" in n for n in io.notes)
