"""Deriving DecoderIO from the graph alone: pairing rules, roles, and every way it must refuse."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from sigbuild import (
    PortSpec,
    base_inputs,
    kv_ports,
    logits_port,
    qwen3_dense,
    qwen36_27b,
    sig_model,
    write_package,
)

from onnxgen.errors import AmbiguousIOError, DecoderIOError
from onnxgen.model import DecoderIO, ModelPackage, derive_io


def _io(tmp_path: Path, model: onnx.ModelProto, files: dict[str, object] | None = None) -> DecoderIO:
    return ModelPackage.open(write_package(tmp_path, model, files or {})).io


def _hybrid(
    state_in: list[PortSpec], state_out: list[PortSpec], kv_layers: tuple[int, ...] = (1,)
) -> onnx.ModelProto:
    kin, kout = kv_ports(kv_layers, 2, 16)
    return sig_model([*base_inputs(), *kin, *state_in], [logits_port(), *kout, *state_out])


def test_qwen36_27b_signature_gives_16_kv_pairs_and_96_state_pairs(tmp_path: Path) -> None:
    io = _io(tmp_path, qwen36_27b())
    assert io.source == "graph"
    assert [p.layer for p in io.kv_pairs] == list(range(3, 64, 4))
    assert sum(len(p.inputs) for p in io.kv_pairs) == 32
    assert {(p.kv_heads, p.head_dim) for p in io.kv_pairs} == {(4, 256)}
    assert io.kv_pairs[0].present_key == "present.3.key"
    assert len(io.state_pairs) == 96
    conv = [s for s in io.state_pairs if s.kind == "conv"]
    rec = [s for s in io.state_pairs if s.kind == "recurrent"]
    assert len(conv) == len(rec) == 48
    # present state shapes are fully symbolic: the static extents come from the past side
    assert {s.shape for s in conv} == {("batch", 10240, 3)}
    assert {s.shape for s in rec} == {("batch", 48, 128, 128)}
    assert (
        rec[0].input == "past_key_values.0.recurrent_state" and rec[0].output == "present.0.recurrent_state"
    )
    assert io.position_ids == "position_ids" and io.position_ids_rank == 3
    assert io.is_hybrid


def test_dense_qwen3_derives_kv_pairs_and_no_state_pair(tmp_path: Path) -> None:
    io = _io(tmp_path, qwen3_dense(28))
    assert len(io.kv_pairs) == 28
    assert io.state_pairs == ()
    assert not io.is_hybrid
    assert (io.kv_pairs[5].kv_heads, io.kv_pairs[5].head_dim) == (8, 128)
    assert (io.token_input, io.attention_mask, io.position_ids, io.logits) == (
        "input_ids",
        "attention_mask",
        "position_ids",
        "logits",
    )


def test_derive_io_function_equals_the_cached_package_io(tmp_path: Path) -> None:
    pkg = ModelPackage.open(write_package(tmp_path, qwen3_dense(2)))
    assert derive_io(pkg) == pkg.io
    assert pkg.io is pkg.io


@pytest.mark.parametrize(
    ("past", "present"),
    [("past_key_values", "present"), ("past_key_values", "present_key_values"), ("past", "present")],
)
def test_kv_name_variants_pair(tmp_path: Path, past: str, present: str) -> None:
    kin, kout = kv_ports([0, 1], 2, 16, past=past, present=present)
    io = _io(tmp_path, sig_model([*base_inputs(), *kin], [logits_port(), *kout]))
    assert [(p.past_key, p.present_value) for p in io.kv_pairs] == [
        (f"{past}.0.key", f"{present}.0.value"),
        (f"{past}.1.key", f"{present}.1.value"),
    ]
    assert io.state_pairs == ()


@pytest.mark.parametrize(
    ("past", "present", "kind"),
    [
        ("past_key_values.0.conv_state", "present.0.conv_state", "conv"),
        ("past.0.recurrent", "present.0.recurrent", "recurrent"),
        ("past.0.conv", "present.0.conv", "conv"),
        ("past_key_values.0.ssm_state", "present_key_values.0.ssm_state", "recurrent"),
    ],
)
def test_state_name_variants_pair_by_suffix(tmp_path: Path, past: str, present: str, kind: str) -> None:
    io = _io(
        tmp_path, _hybrid([(past, "float32", ["batch", 96, 3])], [(present, "float32", ["batch", 96, 3])])
    )
    assert [(s.input, s.output, s.kind, s.layer, s.shape) for s in io.state_pairs] == [
        (past, present, kind, 0, ("batch", 96, 3))
    ]


def test_symbolic_axis_on_either_side_is_a_wildcard(tmp_path: Path) -> None:
    io = _io(
        tmp_path,
        _hybrid(
            [
                ("past.0.conv", "float32", ["batch", "c", 3]),
                ("past.0.recurrent", "float32", ["batch", 4, 16, 16]),
            ],
            [("present.0.conv", "float32", ["batch", 96, "k"]), ("present.0.recurrent", "float32", None)],
        ),
    )
    shapes = {s.kind: s.shape for s in io.state_pairs}
    assert shapes == {"conv": ("batch", 96, 3), "recurrent": ("batch", 4, 16, 16)}


def test_concrete_state_mismatch_is_an_error_naming_both_ports(tmp_path: Path) -> None:
    model = _hybrid(
        [("past.0.conv", "float32", ["batch", 96, 3])], [("present.0.conv", "float32", ["batch", 96, 4])]
    )
    with pytest.raises(
        DecoderIOError, match=r"'past\.0\.conv' \[batch, 96, 3\] and its present 'present\.0\.conv'"
    ):
        _io(tmp_path, model)


def test_state_dtype_mismatch_is_an_error(tmp_path: Path) -> None:
    model = _hybrid(
        [("past.0.conv", "float32", ["batch", 96, 3])], [("present.0.conv", "float16", ["batch", 96, 3])]
    )
    with pytest.raises(
        DecoderIOError, match=r"'past\.0\.conv' is float32 but its present 'present\.0\.conv' is float16"
    ):
        _io(tmp_path, model)


def test_kv_dtype_mismatch_is_an_error(tmp_path: Path) -> None:
    kin, kout = kv_ports([0], 2, 16)
    kout[0] = ("present.0.key", "float16", ["batch", 2, "total", 16])
    with pytest.raises(DecoderIOError, match=r"past_key_values\.0\.key' is float32 but its present"):
        _io(tmp_path, sig_model([*base_inputs(), *kin], [logits_port(), *kout]))


def test_kv_concrete_head_mismatch_is_an_error_but_sequence_lengths_may_differ(tmp_path: Path) -> None:
    kin, kout = kv_ports([0], 2, 16)
    kin = [(n, d, ["batch", 2, 128, 16]) for n, d, _ in kin]
    kout = [(n, d, ["batch", 2, 129, 16]) for n, d, _ in kout]
    assert len(_io(tmp_path / "ok", sig_model([*base_inputs(), *kin], [logits_port(), *kout])).kv_pairs) == 1
    kout[0] = ("present.0.key", "float32", ["batch", 4, 129, 16])
    with pytest.raises(DecoderIOError, match="differ in a concrete extent"):
        _io(tmp_path / "bad", sig_model([*base_inputs(), *kin], [logits_port(), *kout]))


def test_unpaired_state_input_is_an_error_naming_it(tmp_path: Path) -> None:
    model = _hybrid([("past.0.conv", "float32", ["batch", 96, 3])], [])
    with pytest.raises(DecoderIOError, match=r"past input\(s\) past\.0\.conv have no matching present"):
        _io(tmp_path, model)


def test_present_state_without_past_is_an_error_naming_it(tmp_path: Path) -> None:
    model = _hybrid([], [("present.2.recurrent", "float32", ["batch", 4, 16, 16])])
    with pytest.raises(
        DecoderIOError, match=r"present output\(s\) present\.2\.recurrent have no matching past"
    ):
        _io(tmp_path, model)


def test_state_without_any_static_extent_is_an_error(tmp_path: Path) -> None:
    model = _hybrid(
        [("past.0.conv", "float32", ["batch", "c", 3])], [("present.0.conv", "float32", ["batch", "c2", 3])]
    )
    with pytest.raises(
        DecoderIOError, match=r"no static extent on axis 1.*declare it in inference_metadata\.yaml"
    ):
        _io(tmp_path, model)


def test_kv_key_without_value_is_an_error(tmp_path: Path) -> None:
    kin, kout = kv_ports([0], 2, 16)
    model = sig_model([*base_inputs(), kin[0]], [logits_port(), kout[0]])
    with pytest.raises(DecoderIOError, match=r"past_key_values\.0\.key have no key/value partner"):
        _io(tmp_path, model)


def test_two_rank2_integer_candidates_for_the_token_input_are_ambiguous(tmp_path: Path) -> None:
    model = sig_model(
        [("tokens", "int64", ["batch", "seq"]), ("segment_ids", "int64", ["batch", "seq"])], [logits_port()]
    )
    with pytest.raises(AmbiguousIOError) as err:
        _io(tmp_path, model)
    message = str(err.value)
    assert "tokens" in message and "segment_ids" in message
    assert "inference_metadata.yaml" in message and "token_input" in message


def test_the_only_rank2_integer_input_is_the_token_input(tmp_path: Path) -> None:
    model = sig_model(
        [("tokens", "int32", ["batch", "seq"]), ("attention_mask", "int64", ["b", "t"])], [logits_port()]
    )
    io = _io(tmp_path, model)
    assert io.token_input == "tokens"
    assert io.attention_mask == "attention_mask"
    assert io.position_ids is None


def test_logits_fall_back_to_the_only_float_rank3_output_and_hidden_states_are_optional(
    tmp_path: Path,
) -> None:
    model = sig_model(
        base_inputs(),
        [
            ("scores", "float32", ["batch", "seq", 320]),
            ("last_hidden_state", "float32", ["batch", "seq", 64]),
        ],
    )
    io = _io(tmp_path, model)
    assert io.logits == "scores"
    assert io.hidden_states == ("last_hidden_state",)


def test_two_logits_candidates_are_ambiguous(tmp_path: Path) -> None:
    model = sig_model(base_inputs(), [("a", "float32", ["b", "s", 320]), ("c", "float32", ["b", "s", 320])])
    with pytest.raises(AmbiguousIOError, match="logits_output"):
        _io(tmp_path, model)


def test_an_input_onnxgen_cannot_feed_is_an_error_naming_it(tmp_path: Path) -> None:
    model = sig_model([*base_inputs(), ("cache_position", "int64", ["seq"])], [logits_port()])
    with pytest.raises(DecoderIOError, match=r"does not know how to feed graph input\(s\) 'cache_position'"):
        _io(tmp_path, model)


def test_position_ids_of_rank_4_are_rejected(tmp_path: Path) -> None:
    model = sig_model([*base_inputs(None), ("position_ids", "int64", [1, 3, "b", "s"])], [logits_port()])
    with pytest.raises(DecoderIOError, match=r"'position_ids' \(position ids\)"):
        _io(tmp_path, model)


def test_a_dense_graph_without_position_ids_derives_none(tmp_path: Path) -> None:
    kin, kout = kv_ports([0], 2, 16)
    io = _io(tmp_path, sig_model([*base_inputs(None), *kin], [logits_port(), *kout]))
    assert io.position_ids is None
    assert len(io.kv_pairs) == 1
