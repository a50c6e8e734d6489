"""Each family's graph ports and ops are the ones its exporter writes."""

from __future__ import annotations

import onnx
import pytest

from onnxgen.testing import FAMILIES, TinySpec, build_model

DENSE = TinySpec()
HYBRID = TinySpec.hybrid(num_layers=8)  # attention at layers 3 and 7
Dims = list[int | str]


def dims(vi: onnx.ValueInfoProto) -> Dims:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, onnx.GraphProto]:
    root = tmp_path_factory.mktemp("ports")
    out = {}
    for family in FAMILIES:
        spec = HYBRID if family.startswith("hybrid") else DENSE
        path = build_model(root / family, family, spec) / "model.onnx"
        out[family] = onnx.load(str(path), load_external_data=False).graph
    return out


def inputs(g: onnx.GraphProto) -> dict[str, Dims]:
    return {i.name: dims(i) for i in g.input}


def outputs(g: onnx.GraphProto) -> dict[str, Dims]:
    return {o.name: dims(o) for o in g.output}


def ops(g: onnx.GraphProto) -> set[tuple[str, str]]:
    return {(n.domain, n.op_type) for n in g.node}


def test_genai_dense_has_no_position_ids_and_fuses_rotary_into_group_query_attention(
    graphs: dict[str, onnx.GraphProto],
) -> None:
    g = graphs["genai-dense"]
    ins = inputs(g)
    assert list(ins)[:2] == ["input_ids", "attention_mask"]
    assert "position_ids" not in ins
    assert ins["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert ins["past_key_values.0.key"] == ["batch_size", 2, "past_sequence_length", 16]
    assert outputs(g)["present.3.value"] == ["batch_size", 2, "total_sequence_length", 16]
    assert outputs(g)["logits"] == ["batch_size", "sequence_length", DENSE.vocab_size]
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == DENSE.num_layers and all(n.domain == "com.microsoft" for n in gqa)
    assert all({a.name: a.i for a in n.attribute}["do_rotary"] == 1 for n in gqa)
    assert gqa[0].input[5:7] == ["seqlens_k", "total_sequence_length"]
    assert ("com.microsoft", "SkipSimplifiedLayerNormalization") in ops(g)


def test_standard_dense_uses_only_standard_onnx_ops_and_rank_2_position_ids(
    graphs: dict[str, onnx.GraphProto],
) -> None:
    g = graphs["standard-dense"]
    assert {domain for domain, _ in ops(g)} == {""}
    assert inputs(g)["position_ids"] == ["batch_size", "sequence_length"]
    assert ("", "Softmax") in ops(g) and ("", "Concat") in ops(g)


def test_hybrid_genai_has_kv_ports_only_for_attention_layers_and_fixed_state_ports(
    graphs: dict[str, onnx.GraphProto],
) -> None:
    g, s = graphs["hybrid-genai"], HYBRID
    ins, outs = inputs(g), outputs(g)
    assert ins["position_ids"] == [3, "batch_size", "sequence_length"]
    assert sorted(n for n in ins if n.startswith("past_key_values.")) == [
        f"past_key_values.{i}.{kv}" for i in (3, 7) for kv in ("key", "value")
    ]
    conv = ["batch_size", s.conv_dim, s.conv_kernel - 1]
    rec = ["batch_size", s.lin_value_heads, s.lin_key_dim, s.lin_value_dim]
    for layer in (0, 1, 2, 4, 5, 6):
        assert ins[f"past.{layer}.conv"] == conv and outs[f"present.{layer}.conv"] == conv
        assert ins[f"past.{layer}.recurrent"] == rec and outs[f"present.{layer}.recurrent"] == rec
    assert "past.3.conv" not in ins
    assert ("com.microsoft", "MRotaryEmbedding") in ops(g)


@pytest.mark.parametrize("family", ["hybrid-mobius", "hybrid-scan"])
def test_mobius_families_name_states_after_the_layer_and_leave_present_shapes_symbolic(
    graphs: dict[str, onnx.GraphProto], family: str
) -> None:
    g = graphs[family]
    ins, outs = inputs(g), outputs(g)
    assert ins["position_ids"] == ["batch_size", "sequence_length"]
    assert ins["past_key_values.0.conv_state"] == ["batch_size", HYBRID.conv_dim, HYBRID.conv_kernel - 1]
    assert "past_key_values.7.key" in ins and "past_key_values.6.key" not in ins
    present = outs["present.0.recurrent_state"]
    assert len(present) == 4 and all(isinstance(d, str) for d in present)
    assert len(set(outs["present.0.conv_state"][1:]) & set(outs["present.1.conv_state"][1:])) == 0


def test_hybrid_scan_runs_its_recurrence_in_a_scan_and_mobius_in_fused_ops(
    graphs: dict[str, onnx.GraphProto],
) -> None:
    scan, mobius = ops(graphs["hybrid-scan"]), ops(graphs["hybrid-mobius"])
    assert ("", "Scan") in scan and {d for d, _ in scan} == {""}
    assert ("", "Scan") not in mobius
    assert ("com.microsoft", "LinearAttention") in mobius


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_and_state_outputs_follow_logits_in_layer_order(
    graphs: dict[str, onnx.GraphProto], family: str
) -> None:
    g = graphs[family]
    past = [i.name for i in g.input if i.name.startswith("past")]
    present = [o.name for o in g.output][1:]
    assert g.output[0].name == "logits"
    assert [p.replace("past_key_values.", "present.").replace("past.", "present.") for p in past] == present
