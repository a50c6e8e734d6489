"""The helpers of onnxgen.testing.hf: builder errors, the tiny tokenizer, tokenizer round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from onnxgen.testing._hf_tokenizer import SPECIAL_TOKENS, train_tokenizer
from onnxgen.testing.hf import GenaiBuilderError, export_with_genai_builder

if TYPE_CHECKING:
    from conftest import TinyExport, TinyExports

pytestmark = pytest.mark.external

TEXT = "Hello, world! The quick brown fox, 3.14159, naïve café, 日本語.\n\n  def f(x):\n    return x\n"


def test_export_refuses_a_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(GenaiBuilderError, match=r"has no config\.json"):
        export_with_genai_builder(tmp_path, tmp_path / "out")


def test_export_reports_an_unsupported_architecture_with_the_builder_output(
    tiny_exports: TinyExports, tmp_path: Path
) -> None:
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_exports.checkpoint("llama"), hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(GenaiBuilderError) as err:
        export_with_genai_builder(hf_dir, tmp_path / "out")
    assert str(hf_dir) in str(err.value)
    assert "is not currently supported" in str(err.value)  # the builder's own message, from its output tail
    assert "pip install" not in str(err.value)  # the install hint is only for missing modules


@pytest.mark.parametrize("vocab_size", [300, 512, 4096])
def test_tiny_tokenizer_has_exactly_the_requested_ids_and_is_deterministic(vocab_size: int) -> None:
    a, b = train_tokenizer(vocab_size), train_tokenizer(vocab_size)
    assert a.get_vocab_size() == vocab_size
    assert a.get_vocab() == b.get_vocab()
    assert [a.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert a.decode(a.encode(TEXT).ids) == TEXT


def test_tiny_tokenizer_rejects_a_vocab_smaller_than_its_byte_alphabet() -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(100)


def test_export_tokenizer_encodes_like_the_checkpoint_tokenizer(tiny_export: TinyExport) -> None:
    from tokenizers import Tokenizer

    ckpt = Tokenizer.from_file(str(tiny_export.hf_dir / "tokenizer.json"))
    exported = Tokenizer.from_file(str(tiny_export.onnx_dir / "tokenizer.json"))
    assert exported.encode(TEXT).ids == ckpt.encode(TEXT).ids


def test_onnxruntime_genai_tokenizer_encodes_like_the_checkpoint_tokenizer(tiny_export: TinyExport) -> None:
    import onnxruntime_genai as og
    from tokenizers import Tokenizer

    ckpt = Tokenizer.from_file(str(tiny_export.hf_dir / "tokenizer.json"))
    tok = og.Tokenizer(og.Model(str(tiny_export.onnx_dir)))
    assert [int(t) for t in tok.encode(TEXT)] == ckpt.encode(TEXT).ids
