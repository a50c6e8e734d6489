"""The config files written beside each tiny model, in each exporter's format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import pytest
import yaml

from onnxgen.testing import TinySpec, build_model

DENSE = TinySpec()
HYBRID = TinySpec.hybrid()
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def ports(path: Path) -> tuple[list[str], list[str]]:
    g = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    return [i.name for i in g.input], [o.name for o in g.output]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("packaging")


def test_genai_dense_writes_a_genai_config_the_builder_would_write(root: Path) -> None:
    path = build_model(root / "gd", "genai-dense", DENSE)
    assert files(path) == sorted(
        [
            "config.json",
            "genai_config.json",
            "generation_config.json",
            "model.onnx",
            "model.onnx.data",
            *TOKENIZER_FILES,
        ]
    )
    cfg = load_json(path / "genai_config.json")
    dec = cfg["model"]["decoder"]
    assert dec["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert dec["outputs"] == {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    assert (dec["head_size"], dec["num_key_value_heads"], dec["num_attention_heads"]) == (16, 2, 4)
    assert (dec["hidden_size"], dec["num_hidden_layers"], dec["filename"]) == (64, 4, "model.onnx")
    assert cfg["model"]["context_length"] == cfg["search"]["max_length"] == DENSE.max_position
    assert cfg["model"]["eos_token_id"] == [0, 2] and cfg["model"]["pad_token_id"] == 0
    assert cfg["model"]["vocab_size"] == DENSE.vocab_size
    assert cfg["search"]["past_present_share_buffer"] is True
    inputs, outputs = ports(path)
    for layer in range(DENSE.num_layers):
        assert dec["inputs"]["past_key_names"] % layer in inputs
        assert dec["outputs"]["present_value_names"] % layer in outputs


def test_hf_config_and_generation_config_describe_the_same_model(root: Path) -> None:
    path = build_model(root / "hf", "hybrid-genai", HYBRID)
    cfg = load_json(path / "config.json")
    assert cfg["num_hidden_layers"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["linear_conv_kernel_dim"] == HYBRID.conv_kernel
    assert load_json(path / "generation_config.json")["eos_token_id"] == [0, 2]


def test_hybrid_genai_config_has_state_templates_and_rank_3_position_ids(root: Path) -> None:
    path = build_model(root / "hg", "hybrid-genai", HYBRID)
    dec = load_json(path / "genai_config.json")["model"]["decoder"]
    assert dec["inputs"]["position_ids"] == "position_ids"
    assert dec["inputs"]["past_conv_names"] == "past.%d.conv"
    assert dec["inputs"]["past_recurrent_names"] == "past.%d.recurrent"
    assert dec["outputs"]["present_conv_names"] == "present.%d.conv"
    assert dec["outputs"]["present_recurrent_names"] == "present.%d.recurrent"
    inputs, outputs = ports(path)
    for layer in HYBRID.linear_layers:
        assert f"past.{layer}.conv" in inputs and f"present.{layer}.recurrent" in outputs


def test_mobius_metadata_pairs_every_kv_and_state_port_of_the_graph(root: Path) -> None:
    path = build_model(root / "hm", "hybrid-mobius", HYBRID)
    assert files(path) == sorted(
        ["inference_metadata.yaml", "model.onnx", "model.onnx.data", *TOKENIZER_FILES]
    )
    io = yaml.safe_load((path / "inference_metadata.yaml").read_text())["model"]["io"]
    assert (io["token_input"], io["attention_mask_input"]) == ("input_ids", "attention_mask")
    assert (io["position_ids_input"], io["logits_output"]) == ("position_ids", "logits")
    assert io["kv_inputs"] == ["past_key_values.3.key", "past_key_values.3.value"]
    assert io["kv_outputs"] == ["present.3.key", "present.3.value"]
    pairs = {p["input"]: p for p in io["state_pairs"]}
    assert pairs["past_key_values.0.recurrent_state"] == {
        "input": "past_key_values.0.recurrent_state",
        "output": "present.0.recurrent_state",
        "init": "zeros",
        "update": "replace",
    }
    inputs, outputs = ports(path)
    declared_in = {
        io["token_input"],
        io["attention_mask_input"],
        io["position_ids_input"],
        *io["kv_inputs"],
        *pairs,
    }
    assert declared_in == set(inputs)
    assert {io["logits_output"], *io["kv_outputs"], *(p["output"] for p in pairs.values())} == set(outputs)


def test_a_mobius_model_with_a_genai_config_gets_kv_templates_but_no_state_templates(root: Path) -> None:
    path = build_model(root / "hmg", "hybrid-mobius", HYBRID, config="genai")
    cfg = load_json(path / "genai_config.json")
    assert "past_key_names" in cfg["model"]["decoder"]["inputs"]
    assert not [k for k in cfg["model"]["decoder"]["inputs"] if "conv" in k or "recurrent" in k]
    assert cfg["search"]["past_present_share_buffer"] is False
    assert not (path / "inference_metadata.yaml").exists()


@pytest.mark.parametrize(
    ("family", "config"), [("standard-dense", None), ("hybrid-mobius", "none"), ("genai-dense", "none")]
)
def test_no_config_exports_carry_only_the_model_and_tokenizer(
    root: Path, family: str, config: str | None
) -> None:
    spec = HYBRID if family.startswith("hybrid") else DENSE
    path = build_model(root / f"none-{family}", family, spec, config=config)
    assert files(path) == sorted(["model.onnx", "model.onnx.data", *TOKENIZER_FILES])


def test_scan_family_writes_mobius_metadata_by_default(root: Path) -> None:
    path = build_model(root / "hs", "hybrid-scan", HYBRID)
    io = yaml.safe_load((path / "inference_metadata.yaml").read_text())["model"]["io"]
    assert len(io["state_pairs"]) == 2 * len(HYBRID.linear_layers)
