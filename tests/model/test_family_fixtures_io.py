"""DecoderIO derived on a real tiny model of every export family (built once per module).

Expected values come from the TinySpec the fixtures are built from, not from the derivation.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from onnxgen.model import DecoderIO, ModelPackage
from onnxgen.model.inspect import describe
from onnxgen.testing import TinySpec, build_model

DENSE, HYBRID = TinySpec(), TinySpec.hybrid()
FAMILIES = {
    # family: (source with its own config, position ids rank or None, state naming, family label)
    "genai-dense": ("genai_config", None, None, "onnxruntime-genai (GroupQueryAttention)"),
    "standard-dense": ("graph", 2, None, "standard ONNX"),
    "hybrid-genai": (
        "genai_config",
        3,
        ("past.{}.conv", "present.{}.recurrent"),
        "hybrid (com.microsoft LinearAttention)",
    ),
    "hybrid-mobius": (
        "declared",
        2,
        ("past_key_values.{}.conv_state", "present.{}.recurrent_state"),
        "hybrid (com.microsoft LinearAttention)",
    ),
    "hybrid-scan": (
        "declared",
        2,
        ("past_key_values.{}.conv_state", "present.{}.recurrent_state"),
        "hybrid (ONNX Scan)",
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("families")
    out: dict[tuple[str, str], Path] = {}
    for family in FAMILIES:
        out[(family, "own")] = build_model(root / family, family)
        out[(family, "none")] = build_model(root / f"{family}-bare", family, config="none")
    return out


def _spec(family: str) -> TinySpec:
    return HYBRID if family.startswith("hybrid") else DENSE


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_fixture_derives_the_topology_of_its_spec(
    built: dict[tuple[str, str], Path], family: str
) -> None:
    source, pos_rank, state_names, _ = FAMILIES[family]
    spec = _spec(family)
    io = ModelPackage.open(built[(family, "own")]).io
    assert io.source == source
    assert (io.token_input, io.attention_mask, io.logits) == ("input_ids", "attention_mask", "logits")
    assert io.position_ids == (None if pos_rank is None else "position_ids")
    if pos_rank is not None:
        assert io.position_ids_rank == pos_rank
    assert [p.layer for p in io.kv_pairs] == spec.attention_layers
    assert {(p.kv_heads, p.head_dim, p.dtype) for p in io.kv_pairs} == {
        (spec.num_kv_heads, spec.head_dim, "float32")
    }
    assert [p.past_key for p in io.kv_pairs] == [f"past_key_values.{i}.key" for i in spec.attention_layers]
    assert [p.present_value for p in io.kv_pairs] == [f"present.{i}.value" for i in spec.attention_layers]
    if state_names is None:
        assert io.state_pairs == ()
        return
    conv = [s for s in io.state_pairs if s.kind == "conv"]
    rec = [s for s in io.state_pairs if s.kind == "recurrent"]
    assert [s.layer for s in conv] == [s.layer for s in rec] == spec.linear_layers
    assert len(io.state_pairs) == 2 * len(spec.linear_layers)
    assert [s.input for s in conv] == [state_names[0].format(i) for i in spec.linear_layers]
    assert [s.output for s in rec] == [state_names[1].format(i) for i in spec.linear_layers]
    assert {s.shape for s in conv} == {("batch", spec.conv_dim, spec.conv_kernel - 1)}
    assert {s.shape for s in rec} == {("batch", spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_graph_alone_derives_the_same_pairs_as_the_family_config(
    built: dict[tuple[str, str], Path], family: str
) -> None:
    with_config = ModelPackage.open(built[(family, "own")]).io
    bare = ModelPackage.open(built[(family, "none")]).io
    assert bare.source == "graph"
    assert bare.kv_pairs == with_config.kv_pairs
    assert bare.state_pairs == with_config.state_pairs
    assert (bare.token_input, bare.attention_mask, bare.position_ids, bare.logits) == (
        with_config.token_input,
        with_config.attention_mask,
        with_config.position_ids,
        with_config.logits,
    )


def _fed_inputs(io: DecoderIO) -> set[str]:
    names = {n for n in (io.token_input, io.attention_mask, io.position_ids) if n}
    names |= {n for p in io.kv_pairs for n in p.inputs}
    return names | {s.input for s in io.state_pairs}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_derived_io_feeds_exactly_the_inputs_onnxruntime_asks_for(
    built: dict[tuple[str, str], Path], family: str
) -> None:
    path = built[(family, "own")]
    io = ModelPackage.open(path).io
    session = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert {i.name for i in session.get_inputs()} == _fed_inputs(io)
    outputs = {o.name for o in session.get_outputs()}
    assert {io.logits} | {n for p in io.kv_pairs for n in p.outputs} | {
        s.output for s in io.state_pairs
    } <= outputs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inspect_names_the_export_family(built: dict[tuple[str, str], Path], family: str) -> None:
    assert describe(ModelPackage.open(built[(family, "own")]))["family"] == FAMILIES[family][3]


def test_group_query_attention_families_share_past_and_present(built: dict[tuple[str, str], Path]) -> None:
    share = {f: ModelPackage.open(built[(f, "own")]).io.past_present_share_buffer for f in FAMILIES}
    assert share == {
        "genai-dense": True,
        "standard-dense": False,
        "hybrid-genai": True,
        "hybrid-mobius": False,
        "hybrid-scan": False,
    }


def test_int4_export_derives_the_same_io_as_fp32(tmp_path: Path, built: dict[tuple[str, str], Path]) -> None:
    int4 = ModelPackage.open(build_model(tmp_path, "hybrid-genai", precision="int4")).io
    fp32 = ModelPackage.open(built[("hybrid-genai", "own")]).io
    assert (int4.kv_pairs, int4.state_pairs) == (fp32.kv_pairs, fp32.state_pairs)
