"""What the converter refuses, with one line naming it, and the ``onnxgen convert`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from gguf_fixtures import Spec, write_gguf

from onnxgen import load
from onnxgen.cli import main
from onnxgen.convert import GGUFConversionError, convert_gguf
from onnxgen.errors import OnnxgenError


def test_an_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    g = write_gguf(tmp_path / "m.gguf", Spec(arch="mamba", qtype=T.Q8_0))
    with pytest.raises(
        GGUFConversionError, match=r"architecture 'mamba'.*supported: llama, qwen2, qwen3"
    ) as e:
        convert_gguf(g.path, tmp_path / "out")
    assert "\n" not in str(e.value) and isinstance(e.value, OnnxgenError)
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.TQ2_0], ids=lambda t: t.name)
def test_an_unmapped_tensor_type_is_refused_by_name(tmp_path: Path, qtype: T) -> None:
    g = write_gguf(tmp_path / "m.gguf", Spec(qtype=qtype))
    with pytest.raises(GGUFConversionError, match=f"'token_embd.weight' has type {qtype.name}") as e:
        convert_gguf(g.path, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_missing_or_foreign_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(GGUFConversionError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    bad = tmp_path / "model.gguf"
    bad.write_text("{}")
    with pytest.raises(GGUFConversionError, match="not a readable GGUF file"):
        convert_gguf(bad, tmp_path / "out")


def test_the_convert_command_writes_a_directory_onnxgen_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g = write_gguf(tmp_path / "m.gguf", Spec(qtype=T.Q4_K))
    assert main(["convert", str(g.path), str(tmp_path / "out"), "--accuracy-level", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {
        "model.onnx",
        "model.onnx.data",
        "tokenizer.json",
        "tokenizer_config.json",
        "genai_config.json",
    } <= names
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"].startswith("{% for m in messages %}")
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    genai = json.loads((tmp_path / "out" / "genai_config.json").read_text())["model"]
    assert (genai["type"], genai["eos_token_id"], genai["decoder"]["num_key_value_heads"]) == (
        "llama",
        261,
        2,
    )
    llm = load(tmp_path / "out")
    assert len(llm.generate("the the", max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_an_end_of_turn_token_joins_the_eos_ids(tmp_path: Path) -> None:
    g = write_gguf(tmp_path / "m.gguf", Spec(qtype=T.Q8_0, eot=259))
    genai = json.loads((convert_gguf(g.path, tmp_path / "out") / "genai_config.json").read_text())["model"]
    assert genai["eos_token_id"] == [261, 259]
    assert load(tmp_path / "out").package.eos_token_ids == (261, 259)


def test_the_convert_command_reports_a_refusal_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g = write_gguf(tmp_path / "m.gguf", Spec(arch="gpt2", qtype=T.Q8_0))
    assert main(["convert", str(g.path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "architecture 'gpt2'" in err and "Traceback" not in err
