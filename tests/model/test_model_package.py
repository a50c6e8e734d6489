"""ModelPackage: finding model.onnx and its files, cheap opening, clear errors, config precedence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from sigbuild import base_inputs, kv_ports, logits_port, sig_model, write_package

from onnxgen.errors import ConfigError, ModelPackageError
from onnxgen.model import ModelPackage


def _tiny() -> onnx.ModelProto:
    kin, kout = kv_ports([0], 2, 16)
    return sig_model([*base_inputs(), *kin], [logits_port(), *kout])


def _with_weight(n: int = 4096) -> onnx.ModelProto:
    """A tiny model whose logits depend on a weight big enough to go to external data."""
    weight = numpy_helper.from_array(np.arange(n, dtype=np.float32), "w")
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["w"], ["w_sum"], keepdims=0),
        helper.make_node("Mul", ["ids_f", "w_sum"], ["prod"]),
        helper.make_node("Unsqueeze", ["prod", "axes"], ["logits"]),
    ]
    axes = numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")
    return sig_model(
        [("input_ids", "int64", ["batch", "seq"])],
        [("logits", "float32", ["batch", "seq", 1])],
        nodes,
        [weight, axes],
    )


def _save_external(model: onnx.ModelProto, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model,
        str(directory / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    return directory


def test_open_finds_model_and_every_config_file_present(tmp_path: Path) -> None:
    files = {
        "inference_metadata.yaml": {"model": {}},
        "genai_config.json": {"model": {}},
        "config.json": {},
        "generation_config.json": {},
        "tokenizer_config.json": {},
        "tokenizer.json": "{}",
        "chat_template.jinja": "{{ messages }}",
    }
    pkg = ModelPackage.open(write_package(tmp_path, _tiny(), files))
    assert pkg.model_path == tmp_path / "model.onnx"
    for kind in ("inference_metadata", "genai_config", "hf_config", "generation_config", "tokenizer_config"):
        assert pkg.config(kind) is not None, kind
    assert pkg.tokenizer_path == tmp_path / "tokenizer.json"
    assert pkg.chat_template_path == tmp_path / "chat_template.jinja"


def test_open_accepts_the_model_file_itself_and_reads_configs_beside_it(tmp_path: Path) -> None:
    write_package(tmp_path, _tiny(), {"config.json": {"max_position_embeddings": 77}})
    pkg = ModelPackage.open(tmp_path / "model.onnx")
    assert pkg.root == tmp_path
    assert pkg.context_length == 77


def test_absent_optional_files_are_none(tmp_path: Path) -> None:
    pkg = ModelPackage.open(write_package(tmp_path, _tiny()))
    assert pkg.genai_config is None and pkg.inference_metadata is None and pkg.tokenizer_path is None
    assert pkg.eos_token_ids == () and pkg.context_length is None


def test_inference_metadata_json_is_read_when_there_is_no_yaml(tmp_path: Path) -> None:
    pkg = ModelPackage.open(
        write_package(tmp_path, _tiny(), {"inference_metadata.json": {"tokens": {"eos_token_id": 9}}})
    )
    assert pkg.eos_token_ids == (9,)


def test_genai_decoder_filename_is_used_when_there_is_no_model_onnx(tmp_path: Path) -> None:
    onnx.save_model(_tiny(), str(tmp_path / "decoder.onnx"))
    write_package(tmp_path, None, {"genai_config.json": {"model": {"decoder": {"filename": "decoder.onnx"}}}})
    assert ModelPackage.open(tmp_path).model_path.name == "decoder.onnx"


def test_missing_model_onnx_is_an_error_naming_the_file(tmp_path: Path) -> None:
    write_package(tmp_path, None, {"config.json": {}})
    with pytest.raises(ModelPackageError, match=r"model\.onnx does not exist"):
        ModelPackage.open(tmp_path)


@pytest.mark.parametrize("genai_config", [False, True])
@pytest.mark.parametrize("given", ["the directory", "model.onnx"])
def test_a_model_onnx_that_is_a_directory_is_one_error_saying_so(
    tmp_path: Path, genai_config: bool, given: str
) -> None:
    configs = (
        {"genai_config.json": {"model": {"decoder": {"filename": "model.onnx"}}}} if genai_config else {}
    )
    write_package(tmp_path, None, configs)
    (tmp_path / "model.onnx").mkdir()
    (tmp_path / "model.onnx" / "model.onnx.data").write_bytes(b"")
    path = tmp_path if given == "the directory" else tmp_path / "model.onnx"
    with pytest.raises(ModelPackageError, match=r"model\.onnx is a directory, not an ONNX file"):
        ModelPackage.open(path)


def test_a_path_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelPackageError, match="does not exist"):
        ModelPackage.open(tmp_path / "nowhere")


def test_truncated_model_onnx_is_an_error_naming_the_file(tmp_path: Path) -> None:
    write_package(tmp_path, _tiny())
    data = (tmp_path / "model.onnx").read_bytes()
    (tmp_path / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelPackageError, match=r"model\.onnx.*truncated"):
        ModelPackage.open(tmp_path)


def test_empty_model_onnx_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(ModelPackageError, match=r"model\.onnx is empty"):
        ModelPackage.open(tmp_path)


def test_graph_is_loaded_without_weights(tmp_path: Path) -> None:
    pkg = ModelPackage.open(_save_external(_with_weight(), tmp_path))
    w = next(t for t in pkg.graph.graph.initializer if t.name == "w")
    assert w.data_location == onnx.TensorProto.EXTERNAL
    assert len(w.raw_data) == 0


def test_missing_external_data_file_is_an_error_naming_it(tmp_path: Path) -> None:
    _save_external(_with_weight(), tmp_path)
    (tmp_path / "model.onnx.data").unlink()
    with pytest.raises(ModelPackageError, match=r"model\.onnx\.data.*missing"):
        ModelPackage.open(tmp_path)


def test_truncated_external_data_file_is_an_error_naming_it(tmp_path: Path) -> None:
    _save_external(_with_weight(), tmp_path)
    data = tmp_path / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ModelPackageError, match=r"model\.onnx\.data is truncated"):
        ModelPackage.open(tmp_path)


@pytest.mark.parametrize(
    "name", ["genai_config.json", "config.json", "generation_config.json", "tokenizer_config.json"]
)
def test_malformed_json_is_a_config_error_naming_file_and_position(tmp_path: Path, name: str) -> None:
    write_package(tmp_path, _tiny(), {name: '{"model": {"context_length": 12,}}'})
    with pytest.raises(ConfigError, match=rf"{name} is not valid JSON: .* line 1 column"):
        ModelPackage.open(tmp_path)


def test_malformed_yaml_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    write_package(tmp_path, _tiny(), {"inference_metadata.yaml": "model:\n  io: [unclosed\n"})
    with pytest.raises(ConfigError, match=r"inference_metadata\.yaml is not valid YAML"):
        ModelPackage.open(tmp_path)


def test_a_config_that_is_not_a_mapping_is_a_config_error(tmp_path: Path) -> None:
    write_package(tmp_path, _tiny(), {"config.json": "[1, 2]"})
    with pytest.raises(ConfigError, match=r"config\.json must hold a mapping"):
        ModelPackage.open(tmp_path)


def test_a_token_id_of_the_wrong_type_is_a_config_error(tmp_path: Path) -> None:
    pkg = ModelPackage.open(write_package(tmp_path, _tiny(), {"config.json": {"eos_token_id": "</s>"}}))
    with pytest.raises(ConfigError, match=r"config\.json: 'eos_token_id' must be"):
        _ = pkg.settings
