"""Deriving stacked and static KV caches, the types of the inputs onnxgen feeds, and refusing the exports
onnxgen does not run with one line that says what they are."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import helper
from sigbuild import PortSpec, base_inputs, kv_ports, logits_port, sig_model, write_package

from onnxgen.errors import DecoderIOError, UnsupportedModelError
from onnxgen.model import DecoderIO, ModelPackage


def _io(tmp_path: Path, model: onnx.ModelProto, files: dict[str, object] | None = None) -> DecoderIO:
    return ModelPackage.open(write_package(tmp_path, model, files or {})).io


def _stacked(layers: int = 2, lead: int | str = 2) -> tuple[list[PortSpec], list[PortSpec]]:
    ins: list[PortSpec] = [(f"past_{i}", "float32", [lead, "batch", 4, "past", 8]) for i in range(layers)]
    outs: list[PortSpec] = [
        (f"present_{i}", "float32", [lead, "batch", 4, "total", 8]) for i in range(layers)
    ]
    return ins, outs


def _static(layers: int = 2, length: int = 32, axis: int | None = None) -> onnx.ModelProto:
    ins: list[PortSpec] = [
        ("input_ids", "int64", ["batch", "seq"]),
        ("position_ids", "int64", ["batch", "seq"]),
    ]
    outs: list[PortSpec] = [logits_port()]
    nodes = []
    for i in range(layers):
        for kind in ("key", "value"):
            ins.append((f"{kind}_cache.{i}", "float32", ["batch", length, 64]))
            outs.append((f"updated_{kind}_cache.{i}", "float32", ["batch", length, 64]))
            attrs = {} if axis is None else {"axis": axis}
            nodes.append(
                helper.make_node(
                    "TensorScatter",
                    [f"{kind}_cache.{i}", f"{kind}_cache.{i}", "write_indices"],
                    [f"updated_{kind}_cache.{i}"],
                    **attrs,
                )
            )
    ins += [("write_indices", "int64", ["batch"]), ("nonpad_kv_seqlen", "int64", ["batch"])]
    return sig_model(ins, outs, nodes)


@pytest.mark.parametrize("lead", [2, "two"])
def test_past_n_of_rank_5_pairs_with_present_n_as_a_stacked_cache(tmp_path: Path, lead: int | str) -> None:
    ins, outs = _stacked(lead=lead)
    io = _io(tmp_path, sig_model([*base_inputs(), *ins], [logits_port(), *outs]))
    assert [(p.layer, p.inputs, p.outputs, p.layout) for p in io.kv_pairs] == [
        (0, ("past_0",), ("present_0",), "stacked"),
        (1, ("past_1",), ("present_1",), "stacked"),
    ]
    assert (io.kv_pairs[0].kv_heads, io.kv_pairs[0].head_dim, io.kv_pairs[0].seq_axis) == (4, 8, 3)
    assert io.kv_pairs[0].buffer_shape(3, 5) == (2, 3, 4, 5, 8)
    assert io.kv_mode == "growing"


def test_genai_config_past_names_template_states_stacked_caches(tmp_path: Path) -> None:
    ins, outs = _stacked(3)
    genai = {
        "model": {
            "decoder": {"inputs": {"past_names": "past_%d"}, "outputs": {"present_names": "present_%d"}}
        }
    }
    io = _io(
        tmp_path, sig_model([*base_inputs(), *ins], [logits_port(), *outs]), {"genai_config.json": genai}
    )
    assert io.source == "genai_config"
    assert [p.past_key for p in io.kv_pairs] == ["past_0", "past_1", "past_2"]
    assert {p.layout for p in io.kv_pairs} == {"stacked"}


def test_a_past_n_whose_leading_extent_is_not_2_is_not_taken_for_a_stacked_cache(tmp_path: Path) -> None:
    ins, outs = _stacked(1, lead=3)
    with pytest.raises(DecoderIOError, match="does not know how to feed graph input"):
        _io(tmp_path, sig_model([*base_inputs(), *ins], [logits_port(), *outs]))


@pytest.mark.parametrize(("axis", "seq_axis"), [(None, 1), (1, 1), (-2, 1)])
def test_key_cache_buffers_with_write_indices_are_a_static_cache(
    tmp_path: Path, axis: int | None, seq_axis: int
) -> None:
    io = _io(tmp_path, _static(axis=axis))
    assert io.kv_mode == "static" and io.attention_mask is None
    assert io.static_cache is not None
    assert (io.static_cache.write_indices, io.static_cache.kv_lengths, io.static_cache.length) == (
        "write_indices",
        "nonpad_kv_seqlen",
        32,
    )
    pair = io.kv_pairs[1]
    assert (pair.past_key, pair.past_value, pair.present_key, pair.present_value) == (
        "key_cache.1",
        "value_cache.1",
        "updated_key_cache.1",
        "updated_value_cache.1",
    )
    assert (pair.layout, pair.seq_axis, pair.buffer_shape(4, 999)) == ("static", seq_axis, (4, 32, 64))


def test_the_declared_static_cache_block_is_read(tmp_path: Path) -> None:
    meta = {
        "model": {
            "io": {
                "token_input": "input_ids",
                "static_cache": {
                    "write_indices_input": "write_indices",
                    "kv_sequence_length_input": "nonpad_kv_seqlen",
                    "key_cache_inputs": ["key_cache.0", "key_cache.1"],
                    "value_cache_inputs": ["value_cache.0", "value_cache.1"],
                    "key_cache_outputs": ["updated_key_cache.0", "updated_key_cache.1"],
                    "value_cache_outputs": ["updated_value_cache.0", "updated_value_cache.1"],
                },
            }
        }
    }
    io = _io(tmp_path, _static(), {"inference_metadata.yaml": meta})
    assert io.source == "declared" and io.kv_mode == "static" and len(io.kv_pairs) == 2
    meta["model"]["io"]["static_cache"]["value_cache_outputs"] = ["updated_value_cache.0"]  # type: ignore[index]
    with pytest.raises(DecoderIOError, match="must be equally long"):
        _io(tmp_path / "short", _static(), {"inference_metadata.yaml": meta})


def test_a_static_cache_without_write_indices_is_an_error_naming_the_input_to_declare(tmp_path: Path) -> None:
    model = _static()
    del model.graph.input[-2]  # write_indices
    model.graph.node[0].input[2] = ""
    with pytest.raises(DecoderIOError, match="no 'write_indices' input"):
        _io(tmp_path, model)


@pytest.mark.parametrize("port", ["input_ids", "attention_mask", "position_ids"])
def test_an_index_input_of_a_type_onnxgen_cannot_write_is_refused_at_load_naming_it(
    tmp_path: Path, port: str
) -> None:
    ins = [(n, "uint8" if n == port else d, s) for n, d, s in base_inputs()]
    with pytest.raises(
        DecoderIOError, match=rf"graph input '{port}' \(.*\) is uint8; onnxgen feeds it as int64"
    ):
        _io(tmp_path, sig_model(ins, [logits_port()]))


def test_int32_index_inputs_are_taken_as_they_are(tmp_path: Path) -> None:
    ins = [(n, "int32", s) for n, _, s in base_inputs()]
    io = _io(tmp_path, sig_model(ins, [logits_port()]))
    assert {io.port(n).dtype for n in (io.token_input, io.attention_mask, io.position_ids)} == {"int32"}


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (("encoder_hidden_states", "float32", ["batch", "enc", 64]), "decoder of an encoder-decoder model"),
        (("past_key_values.0.encoder.key", "float32", ["batch", 2, "enc", 16]), "encoder-decoder"),
        (("block_table", "int32", ["batch", "blocks"]), "paged-attention export"),
    ],
)
def test_exports_onnxgen_does_not_run_get_one_line_saying_what_they_are(
    tmp_path: Path, extra: PortSpec, said: str
) -> None:
    kin, kout = kv_ports([0], 2, 16)
    with pytest.raises(UnsupportedModelError, match=said) as err:
        _io(tmp_path, sig_model([*base_inputs(), *kin, extra], [logits_port(), *kout]))
    assert "\n" not in str(err.value) and "inference_metadata" not in str(err.value)


def test_an_inputs_embeds_decoder_and_a_rank_1_token_export_are_refused(tmp_path: Path) -> None:
    embeds = sig_model(
        [("inputs_embeds", "float32", ["b", "s", 64]), ("attention_mask", "int64", ["b", "t"])],
        [logits_port()],
    )
    with pytest.raises(UnsupportedModelError, match="takes 'inputs_embeds' and no 'input_ids'"):
        _io(tmp_path / "embeds", embeds)
    paged = sig_model(
        [("input_ids", "int64", ["tokens"]), ("past_sequence_lengths", "int32", ["b"])], [logits_port()]
    )
    with pytest.raises(UnsupportedModelError, match=r"rank-1 'input_ids'.*use_paged_attention"):
        _io(tmp_path / "paged", paged)


def test_a_key_only_cache_is_refused_as_such(tmp_path: Path) -> None:
    kin, kout = kv_ports([0], 2, 16)
    model = sig_model([*base_inputs(), kin[0]], [logits_port(), kout[0]])
    with pytest.raises(DecoderIOError, match="key-only"):
        _io(tmp_path, model)
