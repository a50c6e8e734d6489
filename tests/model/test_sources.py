"""resolve_model: every model argument a user gives becomes the right model directory, or one clear line.

Cases: a checkpoint folder (the export command), the ``onnx/model.onnx`` layout (loads and generates as
the plain directory does), a JSON or other non-ONNX file (one line, from the library and the CLI), a hub
id from a pre-populated offline hub cache (``HF_HOME`` / ``HF_HUB_CACHE``), a GGUF file (through the
converter), and a name nothing knows.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
from hub_cache import add_repo, repo_files

from onnxgen.cli import main
from onnxgen.errors import ModelPackageError
from onnxgen.llm import load
from onnxgen.model import ModelPackage, checkpoint
from onnxgen.model.sources import resolve_model
from onnxgen.testing import build_model

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("plain") / "dense", "standard-dense")


@pytest.fixture(scope="module")
def greedy(dense: Path) -> list[int]:
    return load(dense, threads=1).generate(PROMPT, max_new_tokens=6).token_ids


@pytest.fixture(autouse=True)
def _hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ONNXGEN_CACHE_DIR", str(tmp_path / "onnxgen-cache"))
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)
    return cache


def _onnx_layout(dense: Path, out: Path) -> Path:
    """``dense`` as an ONNX hub repository lays it out: model files in onnx/, the rest at the root."""
    for name, source in repo_files(dense, onnx_folder=True).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, out / name)
    return out


def _checkpoint(folder: Path, model_type: str = "llama") -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    return folder


def _one_line(err: str, command: str) -> str:
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0, err
    assert err.startswith(f"onnxgen {command}: error: ")
    return err


# -- checkpoints -------------------------------------------------------------------------------------
def test_a_checkpoint_folder_is_named_a_checkpoint_with_the_builder_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint, "_installed", lambda module: module == "onnxruntime_genai")
    folder = _checkpoint(tmp_path / "SmolLM2-135M")
    for call in (resolve_model, ModelPackage.open):
        with pytest.raises(ModelPackageError) as e:
            call(folder)
        message = str(e.value)
        assert f"{folder} is a Hugging Face checkpoint" in message
        assert (
            f"python -m onnxruntime_genai.models.builder -i {folder} -o {folder}-onnx -p int4 -e cpu"
            in message
        )
        assert "torch==2.13.0" in message and "transformers" in message


@pytest.mark.parametrize(
    ("installed", "command"),
    [
        ({"onnxruntime_genai", "mobius"}, "python -m onnxruntime_genai.models.builder"),
        ({"mobius"}, "mobius build --config"),  # the exporter there is
        (set(), "python -m onnxruntime_genai.models.builder"),  # neither: the builder, with its packages
    ],
)
def test_the_export_command_is_the_installed_exporters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: set[str], command: str
) -> None:
    monkeypatch.setattr(checkpoint, "_installed", lambda module: module in installed)
    with pytest.raises(ModelPackageError) as e:
        resolve_model(_checkpoint(tmp_path / "ckpt"))
    assert command in str(e.value) and "pip install" in str(e.value)


def test_a_hybrid_checkpoint_gets_the_mobius_command(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "Qwen3.5", "qwen3_next")
    with pytest.raises(ModelPackageError, match=r"mobius build --config .*Qwen3\.5 .* --runtime onnx-genai"):
        resolve_model(folder)


def test_a_checkpoint_folder_on_the_command_line_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _checkpoint(tmp_path / "ckpt")
    assert main(["generate", str(folder), PROMPT]) == 2
    err = _one_line(capsys.readouterr().err, "generate")
    assert "is a Hugging Face checkpoint" in err and "export it first" in err


def test_a_folder_with_weights_but_no_config_is_not_called_a_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(ModelPackageError) as e:
        ModelPackage.open(folder)
    assert "checkpoint" not in str(e.value) and "model.onnx does not exist" in str(e.value)


# -- the onnx/ layout ----------------------------------------------------------------------------------
def test_the_onnx_folder_layout_generates_what_the_plain_directory_does(
    dense: Path, greedy: list[int], tmp_path: Path
) -> None:
    repo = _onnx_layout(dense, tmp_path / "repo")
    assert not (repo / "model.onnx").exists() and (repo / "onnx" / "model.onnx").is_file()
    package = ModelPackage.open(repo)
    assert package.model_path == repo / "onnx" / "model.onnx"
    assert package.root == repo and package.tokenizer_path == repo / "tokenizer.json"
    assert package.configs.keys() == ModelPackage.open(dense).configs.keys()
    assert load(repo, threads=1).generate(PROMPT, max_new_tokens=6).token_ids == greedy
    # the model file inside onnx/ given directly: the tokenizer and configs are still the root's
    assert ModelPackage.open(repo / "onnx" / "model.onnx").root == repo


def test_an_onnx_folder_with_its_own_tokenizer_keeps_it(dense: Path, tmp_path: Path) -> None:
    folder = tmp_path / "x" / "onnx"
    shutil.copytree(dense, folder)
    (folder.parent / "tokenizer.json").write_text("not read")  # the model's own folder comes first
    assert ModelPackage.open(folder).root == folder


# -- files that are not a model ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "inference_metadata.yaml"])
def test_a_config_file_given_as_the_model_is_one_line_naming_it(
    dense: Path, tmp_path: Path, name: str
) -> None:
    path = tmp_path / name
    path.write_text('{"a": 1}')
    kind = path.suffix.lstrip(".").upper()
    for call in (resolve_model, ModelPackage.open):
        with pytest.raises(
            ModelPackageError, match=rf"is a {kind} file, not a model; pass a model directory"
        ):
            call(path)


def test_a_json_file_on_the_command_line_is_one_error_line_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 576}))
    for command in (["generate", str(config), PROMPT], ["inspect", str(config)], ["chat", str(config)]):
        assert main(command) == 2
        err = _one_line(capsys.readouterr().err, command[0])
        assert f"{config} is a JSON file, not a model" in err


def test_a_config_file_beside_a_model_points_at_its_folder(dense: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(dense, folder)
    (folder / "genai_config.json").write_text("{}")
    with pytest.raises(ModelPackageError, match=rf"not a model; pass the folder that holds it: {folder}$"):
        resolve_model(folder / "genai_config.json")


def test_a_protobuf_text_file_that_does_not_parse_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx.textproto"  # onnx.load reads this suffix as protobuf text
    path.write_text("graph { this is not }")
    with pytest.raises(ModelPackageError, match="cannot be parsed as ONNX"):
        ModelPackage.open(path)


# -- hub ids ---------------------------------------------------------------------------------------------
def test_a_hub_id_resolves_from_the_offline_hub_cache_under_hf_home(
    dense: Path, greedy: list[int], _hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = add_repo(_hub_cache, "tiny-org/tiny-onnx", repo_files(dense, onnx_folder=True))
    assert resolve_model("tiny-org/tiny-onnx") == snapshot
    assert load("tiny-org/tiny-onnx", threads=1).generate(PROMPT, max_new_tokens=6).token_ids == greedy
    assert (
        main(["generate", "tiny-org/tiny-onnx", PROMPT, "-n", "6", "--temp", "0", "--json", "--no-stream"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy


def test_hf_hub_cache_wins_over_hf_home(
    dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _hub_cache: Path
) -> None:
    add_repo(_hub_cache, "tiny-org/tiny", repo_files(dense))
    other = tmp_path / "other-cache"
    snapshot = add_repo(other, "tiny-org/tiny", repo_files(dense))
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_model("tiny-org/tiny") == snapshot


def test_a_hub_id_not_in_the_cache_says_how_to_pull_it(_hub_cache: Path) -> None:
    with pytest.raises(ModelPackageError) as e:
        resolve_model("tiny-org/missing")
    assert f"not in the Hugging Face cache ({_hub_cache})" in str(e.value)
    assert "onnxgen pull tiny-org/missing" in str(e.value)


def test_a_cached_hub_checkpoint_gets_the_export_command(tmp_path: Path, _hub_cache: Path) -> None:
    folder = _checkpoint(tmp_path / "ckpt")
    add_repo(_hub_cache, "tiny-org/ckpt", {p.name: p for p in folder.iterdir()})
    with pytest.raises(ModelPackageError, match="is a Hugging Face checkpoint"):
        resolve_model("tiny-org/ckpt")


# -- GGUF files and names --------------------------------------------------------------------------------
@pytest.fixture
def converter(dense: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """A stand-in for onnxgen.convert: records each GGUF file it is given and returns ``dense``."""
    seen: list[Path] = []

    def cached_gguf_model(src: Path, cache_root: Path | None = None) -> Path:
        seen.append(Path(src))
        return dense

    fake = types.ModuleType("onnxgen.convert")
    fake.cached_gguf_model = cached_gguf_model  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "onnxgen.convert", fake)
    return seen


def test_a_gguf_file_is_converted_and_its_directory_run(
    dense: Path, greedy: list[int], tmp_path: Path, converter: list[Path]
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    assert resolve_model(gguf) == dense and converter == [gguf]
    unnamed = tmp_path / "weights"  # no suffix: the GGUF magic says what it is
    unnamed.write_bytes(b"GGUF" + b"\0" * 16)
    assert resolve_model(unnamed) == dense and converter[-1] == unnamed
    assert load(gguf, threads=1).generate(PROMPT, max_new_tokens=6).token_ids == greedy


def test_a_folder_of_one_gguf_file_runs_it_and_of_two_asks_which(
    tmp_path: Path, converter: list[Path]
) -> None:
    folder = tmp_path / "ggufs"
    folder.mkdir()
    (folder / "a.Q4_0.gguf").write_bytes(b"GGUF")
    resolve_model(folder)
    assert converter == [folder / "a.Q4_0.gguf"]
    (folder / "a.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelPackageError, match=r"several GGUF files \(a.Q4_0.gguf, a.Q8_0.gguf\)"):
        resolve_model(folder)


def test_a_directory_and_an_onnx_file_resolve_to_themselves(dense: Path) -> None:
    assert resolve_model(dense) == dense and resolve_model(str(dense / "model.onnx")) == dense / "model.onnx"


def test_a_known_name_not_yet_pulled_and_an_unknown_name_say_what_to_do() -> None:
    with pytest.raises(
        ModelPackageError, match=r"has not been pulled yet; .*onnxgen pull smollm2-135m-instruct"
    ):
        resolve_model("smollm2-135m-instruct")
    with pytest.raises(
        ModelPackageError, match=r"model no-such-model does not exist; pass a model directory"
    ):
        resolve_model("no-such-model")
