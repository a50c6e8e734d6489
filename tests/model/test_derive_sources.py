"""Declared inference_metadata model.io and genai_config templates, and their precedence."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from sigbuild import PortSpec, base_inputs, kv_ports, logits_port, sig_model, write_package

from onnxgen.errors import AmbiguousIOError, ConfigError, DecoderIOError
from onnxgen.model import DecoderIO, ModelPackage


def _io(tmp_path: Path, model: onnx.ModelProto, files: dict[str, object]) -> DecoderIO:
    return ModelPackage.open(write_package(tmp_path, model, files)).io


def _ort_genai_hybrid() -> onnx.ModelProto:
    """onnxruntime-genai naming: KV at layer 3, past.N.conv / past.N.recurrent at layers 0-2."""
    kin, kout = kv_ports([3], 2, 16)
    sin: list[PortSpec] = []
    sout: list[PortSpec] = []
    for i in range(3):
        sin += [
            (f"past.{i}.conv", "float32", ["batch", 96, 3]),
            (f"past.{i}.recurrent", "float32", ["batch", 4, 16, 16]),
        ]
        sout += [
            (f"present.{i}.conv", "float32", ["batch", 96, 3]),
            (f"present.{i}.recurrent", "float32", ["batch", 4, 16, 16]),
        ]
    return sig_model([*base_inputs(position_rank=3), *kin, *sin], [logits_port(), *kout, *sout])


GENAI_HYBRID = {
    "model": {
        "decoder": {
            "inputs": {
                "input_ids": "input_ids",
                "attention_mask": "attention_mask",
                "position_ids": "position_ids",
                "past_key_names": "past_key_values.%d.key",
                "past_value_names": "past_key_values.%d.value",
                "past_conv_names": "past.%d.conv",
                "past_recurrent_names": "past.%d.recurrent",
            },
            "outputs": {
                "logits": "logits",
                "present_key_names": "present.%d.key",
                "present_value_names": "present.%d.value",
                "present_conv_names": "present.%d.conv",
                "present_recurrent_names": "present.%d.recurrent",
            },
        }
    }
}


def test_genai_templates_with_conv_and_recurrent_names_expand_over_graph_layers(tmp_path: Path) -> None:
    io = _io(tmp_path, _ort_genai_hybrid(), {"genai_config.json": GENAI_HYBRID})
    assert io.source == "genai_config"
    assert [p.layer for p in io.kv_pairs] == [3]
    assert [(s.layer, s.kind, s.input, s.output) for s in io.state_pairs] == [
        (0, "conv", "past.0.conv", "present.0.conv"),
        (0, "recurrent", "past.0.recurrent", "present.0.recurrent"),
        (1, "conv", "past.1.conv", "present.1.conv"),
        (1, "recurrent", "past.1.recurrent", "present.1.recurrent"),
        (2, "conv", "past.2.conv", "present.2.conv"),
        (2, "recurrent", "past.2.recurrent", "present.2.recurrent"),
    ]
    assert io.position_ids_rank == 3


def test_genai_template_naming_a_present_the_graph_lacks_is_an_error(tmp_path: Path) -> None:
    cfg = {"model": {"decoder": {**GENAI_HYBRID["model"]["decoder"]}}}
    cfg["model"]["decoder"]["outputs"] = {
        **cfg["model"]["decoder"]["outputs"],
        "present_conv_names": "present.%d.conv_state",
    }
    with pytest.raises(
        DecoderIOError, match=r"genai_config\.json model\.decoder names output 'present\.0\.conv_state'"
    ):
        _io(tmp_path, _ort_genai_hybrid(), {"genai_config.json": cfg})


def test_genai_config_without_state_templates_leaves_states_to_the_graph(tmp_path: Path) -> None:
    decoder = GENAI_HYBRID["model"]["decoder"]
    ins = {k: v for k, v in decoder["inputs"].items() if "conv" not in k and "recurrent" not in k}
    outs = {k: v for k, v in decoder["outputs"].items() if "conv" not in k and "recurrent" not in k}
    io = _io(
        tmp_path,
        _ort_genai_hybrid(),
        {"genai_config.json": {"model": {"decoder": {"inputs": ins, "outputs": outs}}}},
    )
    assert io.source == "genai_config"
    assert len(io.state_pairs) == 6
    assert any("states no state pairs; 6 derived from the graph" in n for n in io.notes)


def test_genai_position_ids_the_graph_lacks_are_dropped_with_a_note(tmp_path: Path) -> None:
    kin, kout = kv_ports([0], 2, 16)
    model = sig_model([*base_inputs(None), *kin], [logits_port(), *kout])
    cfg = {"model": {"decoder": {"inputs": {"input_ids": "input_ids", "position_ids": "position_ids"}}}}
    io = _io(tmp_path, model, {"genai_config.json": cfg})
    assert io.position_ids is None
    assert any("position_ids 'position_ids'" in n for n in io.notes)


def test_genai_template_without_percent_d_is_an_error(tmp_path: Path) -> None:
    cfg = {
        "model": {
            "decoder": {
                "inputs": {"past_conv_names": "past.conv"},
                "outputs": {"present_conv_names": "present.%d.conv"},
            }
        }
    }
    with pytest.raises(DecoderIOError, match=r"past_conv_names = 'past\.conv' must contain exactly one %d"):
        _io(tmp_path, _ort_genai_hybrid(), {"genai_config.json": cfg})


def _two_token_model() -> onnx.ModelProto:
    """A graph the graph rules alone cannot settle, or would settle differently from its declaration:
    two rank-2 integer inputs (``tokens``, ``mask``), two logits-like outputs, KV presents under two
    prefixes, and a state pair whose names are not past/present-like."""
    kin, kout = kv_ports([1], 2, 16)
    _, kout2 = kv_ports([1], 2, 16, present="present_key_values")
    return sig_model(
        [
            ("tokens", "int64", ["b", "s"]),
            ("mask", "int64", ["b", "t"]),
            *kin,
            ("state_in", "float32", ["b", 8]),
        ],
        [
            logits_port(),
            ("aux_logits", "float32", ["b", "s", 320]),
            *kout,
            *kout2,
            ("state_out", "float32", ["b", 8]),
        ],
    )


DECLARED = {
    "model": {
        "io": {
            "token_input": "tokens",
            "attention_mask_input": "mask",
            "position_ids_input": None,
            "logits_output": "aux_logits",
            "kv_inputs": ["past_key_values.1.key", "past_key_values.1.value"],
            "kv_outputs": ["present_key_values.1.key", "present_key_values.1.value"],
            "state_pairs": [
                {"input": "state_in", "output": "state_out", "init": "zeros", "update": "replace"}
            ],
        }
    }
}


def test_graph_rules_alone_refuse_the_two_token_model(tmp_path: Path) -> None:
    with pytest.raises(AmbiguousIOError, match=r"declare .*inference_metadata\.yaml"):
        _io(tmp_path, _two_token_model(), {})


def test_declared_io_overrides_what_graph_derivation_would_pick(tmp_path: Path) -> None:
    io = _io(
        tmp_path, _two_token_model(), {"inference_metadata.yaml": DECLARED, "genai_config.json": GENAI_HYBRID}
    )
    assert io.source == "declared"
    assert (io.token_input, io.attention_mask, io.position_ids) == ("tokens", "mask", None)
    assert io.logits == "aux_logits"  # the graph rule would take logits
    assert [(p.present_key, p.present_value) for p in io.kv_pairs] == [
        ("present_key_values.1.key", "present_key_values.1.value")
    ]
    assert [(s.input, s.output, s.shape) for s in io.state_pairs] == [("state_in", "state_out", ("batch", 8))]


def test_declared_io_leaves_unstated_roles_to_the_graph(tmp_path: Path) -> None:
    meta = {"model": {"io": {"logits_output": "logits"}}}
    io = _io(tmp_path, _ort_genai_hybrid(), {"inference_metadata.yml": meta})
    assert io.source == "declared"
    assert (io.token_input, io.attention_mask, io.position_ids) == (
        "input_ids",
        "attention_mask",
        "position_ids",
    )
    assert len(io.kv_pairs) == 1 and len(io.state_pairs) == 6
    assert any("states no KV pairs; 1 derived from the graph" in n for n in io.notes)


def test_declared_state_pairs_are_the_whole_list_and_undeclared_state_ports_are_reported(
    tmp_path: Path,
) -> None:
    meta = {"model": {"io": {"state_pairs": [{"input": "past.0.conv", "output": "present.0.conv"}]}}}
    with pytest.raises(DecoderIOError, match=r"does not know how to feed .*'past\.0\.recurrent'"):
        _io(tmp_path, _ort_genai_hybrid(), {"inference_metadata.json": meta})


def test_declared_port_missing_from_the_graph_is_an_error(tmp_path: Path) -> None:
    meta = {"model": {"io": {"token_input": "input_ids"}}}
    with pytest.raises(DecoderIOError, match=r"inference_metadata\.yaml model\.io names input 'input_ids'"):
        _io(tmp_path, _two_token_model(), {"inference_metadata.yaml": meta})


def test_declared_shape_that_differs_from_the_graph_is_an_error(tmp_path: Path) -> None:
    meta = {
        "model": {
            "io": {"state_pairs": [{"input": "state_in", "output": "state_out", "shape": ["batch", 9]}]}
        }
    }
    with pytest.raises(
        DecoderIOError, match=r"declares 'state_in' with shape \[batch, 9\], but the graph has \[b, 8\]"
    ):
        _io(tmp_path, _two_token_model(), {"inference_metadata.yaml": meta})


def test_declared_concrete_extent_where_the_graph_is_symbolic_is_an_error(tmp_path: Path) -> None:
    meta = {"model": {"io": {"token_input": {"name": "tokens", "shape": [1, "seq"]}}}}
    with pytest.raises(DecoderIOError, match=r"declares 'tokens' with shape \[1, seq\]"):
        _io(tmp_path, _two_token_model(), {"inference_metadata.yaml": meta})


def test_declared_shape_matching_the_graph_is_accepted(tmp_path: Path) -> None:
    meta = {"model": {"io": {**DECLARED["model"]["io"]}}}
    meta["model"]["io"]["state_pairs"] = [
        {"input": "state_in", "output": "state_out", "shape": ["batch", 8], "dtype": "float32"}
    ]
    assert _io(tmp_path, _two_token_model(), {"inference_metadata.yaml": meta}).state_pairs[0].shape == (
        "batch",
        8,
    )


def test_declared_state_update_other_than_replace_is_refused(tmp_path: Path) -> None:
    meta = {
        "model": {"io": {"state_pairs": [{"input": "state_in", "output": "state_out", "update": "append"}]}}
    }
    with pytest.raises(DecoderIOError, match=r"update='append' is not supported"):
        _io(tmp_path, _two_token_model(), {"inference_metadata.yaml": meta})


def test_declared_kv_lists_of_different_length_are_an_error(tmp_path: Path) -> None:
    meta = {"model": {"io": {"kv_inputs": ["past_key_values.1.key"], "kv_outputs": []}}}
    with pytest.raises(DecoderIOError, match="kv_inputs has 1 names but kv_outputs has 0"):
        _io(tmp_path, _two_token_model(), {"inference_metadata.yaml": meta})


def test_declared_model_io_that_is_not_a_mapping_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.io must be a mapping"):
        _io(tmp_path, _two_token_model(), {"inference_metadata.yaml": {"model": {"io": ["input_ids"]}}})
