"""Finding an MTP head beside a decoder and deriving its I/O like a decoder's, plus its hidden-state ports."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import onnxgen
from onnxgen import SamplingParams
from onnxgen.errors import AmbiguousIOError, GenerationError, ModelPackageError
from onnxgen.export.mtp import MTP_FILE, write_mtp_head
from onnxgen.model.mtp import find_mtp_head, mtp_head_io
from onnxgen.model.package import ModelPackage
from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.mtp import geometry_of, make_mtp_weights

SPEC = TinySpec()


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    d = build_model(tmp_path, "genai-dense", SPEC)
    write_mtp_head(d, geometry_of(SPEC), make_mtp_weights(geometry_of(SPEC)))
    return d


def rename(model: onnx.ModelProto, old: str, new: str) -> None:
    for port in (*model.graph.input, *model.graph.output):
        if port.name == old:
            port.name = new
    for node in model.graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]


def test_the_exported_head_is_found_and_its_io_derived_from_the_graph(model_dir: Path) -> None:
    package = ModelPackage.open(model_dir)
    assert package.model_path.name == "model.onnx", "the head beside it must not be taken for the decoder"
    path = find_mtp_head(package)
    assert path == model_dir / MTP_FILE
    head = mtp_head_io(package, path)
    io = head.io
    assert (io.token_input, io.attention_mask, io.position_ids, io.logits) == (
        "input_ids",
        "attention_mask",
        "position_ids",
        "logits",
    )
    assert io.position_ids_rank == 2 and io.past_present_share_buffer
    (kv,) = io.kv_pairs
    assert (kv.past_key, kv.present_value, kv.kv_heads, kv.head_dim) == (
        "past_key_values.0.key",
        "present.0.value",
        SPEC.num_kv_heads,
        SPEC.head_dim,
    )
    assert (head.hidden_input, head.hidden_output, head.hidden_size) == (
        "hidden_states",
        "hidden_states_out",
        SPEC.hidden,
    )
    assert "hidden_states" in {p.name for p in io.input_ports}


def test_a_decoder_of_another_name_is_still_found_beside_its_head(model_dir: Path) -> None:
    (model_dir / "model.onnx").rename(model_dir / "decoder.onnx")
    (model_dir / "genai_config.json").unlink()  # (it names model.onnx)
    package = ModelPackage.open(model_dir)
    assert package.model_path.name == "decoder.onnx"
    assert find_mtp_head(package) == model_dir / MTP_FILE


def test_a_decoder_without_a_head_has_none(tmp_path: Path) -> None:
    assert find_mtp_head(ModelPackage.open(build_model(tmp_path, "genai-dense", SPEC))) is None


def write_genai_section(model_dir: Path, section: dict[str, object]) -> None:
    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["mtp"] = section
    path.write_text(json.dumps(config))


def test_genai_config_names_the_head_file_and_its_hidden_state_ports(model_dir: Path) -> None:
    model = onnx.load(str(model_dir / MTP_FILE), load_external_data=False)
    rename(model, "hidden_states", "target_hidden")
    rename(model, "hidden_states_out", "head_hidden")
    onnx.save(model, str(model_dir / "head.onnx"))
    write_genai_section(
        model_dir,
        {
            "enabled": True,
            "filename": "head.onnx",
            "inputs": {
                "hidden_states": "target_hidden",
                "past_key_names": "past_key_values.%d.key",
                "past_value_names": "past_key_values.%d.value",
            },
            "outputs": {
                "hidden_states": "head_hidden",
                "present_key_names": "present.%d.key",
                "present_value_names": "present.%d.value",
            },
        },
    )
    package = ModelPackage.open(model_dir)
    path = find_mtp_head(package)
    assert path == model_dir / "head.onnx"
    head = mtp_head_io(package, path)
    assert (head.hidden_input, head.hidden_output) == ("target_hidden", "head_hidden")
    assert head.io.source == "genai_config"


def test_a_disabled_section_turns_the_head_off_and_a_missing_file_is_named(model_dir: Path) -> None:
    write_genai_section(model_dir, {"enabled": False, "filename": MTP_FILE})
    assert find_mtp_head(ModelPackage.open(model_dir)) is None
    write_genai_section(model_dir, {"filename": "gone.onnx"})
    with pytest.raises(ModelPackageError, match=r"names gone\.onnx, which is not in"):
        find_mtp_head(ModelPackage.open(model_dir))
    # the model still loads and decodes; MTP speculation says what is wrong
    llm = onnxgen.load(model_dir, threads=1)
    assert llm.generate([5, 6, 7], SamplingParams(max_new_tokens=3)).token_ids
    with pytest.raises(GenerationError, match=r"names gone\.onnx"):
        llm.stream([5, 6, 7], SamplingParams(max_new_tokens=3), speculative=onnxgen.MTP())


def test_unnamed_hidden_state_ports_are_found_by_shape_unless_two_could_be(model_dir: Path) -> None:
    model = onnx.load(str(model_dir / MTP_FILE), load_external_data=False)
    rename(model, "hidden_states", "h")
    rename(model, "hidden_states_out", "h_next")
    onnx.save(model, str(model_dir / MTP_FILE))
    package = ModelPackage.open(model_dir)
    head = mtp_head_io(package, model_dir / MTP_FILE)
    assert (head.hidden_input, head.hidden_output) == ("h", "h_next")
    extra = onnx.helper.make_tensor_value_info("h2", onnx.TensorProto.FLOAT, ["b", "s", SPEC.hidden])
    model.graph.input.append(extra)
    onnx.save(model, str(model_dir / MTP_FILE))
    with pytest.raises(AmbiguousIOError, match="hidden-state input"):
        mtp_head_io(package, model_dir / MTP_FILE)
