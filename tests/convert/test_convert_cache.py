"""``cached_gguf_model``: one conversion per file content and accuracy level, built aside and renamed in;
and the public names of ``onnxgen.convert``."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from gguf_fixtures import Spec, write_gguf

import onnxgen.convert
from onnxgen.config import cache_home
from onnxgen.convert import cached_gguf_model, convert_gguf
from onnxgen.convert.cache import DONE


def test_the_public_api_is_pinned() -> None:
    assert sorted(onnxgen.convert.__all__) == ["GGUFConversionError", "cached_gguf_model", "convert_gguf"]
    assert str(inspect.signature(convert_gguf)) == (
        "(src: 'str | Path', out_dir: 'str | Path', *, accuracy_level: 'int | None' = None, "
        "float_weights: 'str' = 'keep') -> 'Path'"
    )
    assert str(inspect.signature(cached_gguf_model)) == (
        "(src: 'str | Path', cache_root: 'str | Path | None' = None, *, "
        "accuracy_level: 'int | None' = None) -> 'Path'"
    )


def test_a_file_is_converted_once_then_served_from_the_cache(tmp_path: Path) -> None:
    g = write_gguf(tmp_path / "a.gguf", Spec(qtype=T.Q4_0))
    first = cached_gguf_model(g.path, tmp_path / "cache")
    assert (first / "model.onnx").is_file() and (first / DONE).is_file()
    stamp = (first / "model.onnx").stat().st_mtime_ns
    copy = tmp_path / "elsewhere.gguf"  # same bytes, other name: same entry
    copy.write_bytes(g.path.read_bytes())
    assert cached_gguf_model(copy, tmp_path / "cache") == first
    assert (first / "model.onnx").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [first.name]  # no temp dir left


def test_other_content_or_accuracy_level_gets_its_own_entry(tmp_path: Path) -> None:
    a = write_gguf(tmp_path / "a.gguf", Spec(qtype=T.Q4_0))
    b = write_gguf(tmp_path / "b.gguf", Spec(qtype=T.Q4_0, seed=1))
    one = cached_gguf_model(a.path, tmp_path / "cache")
    assert cached_gguf_model(b.path, tmp_path / "cache") != one
    assert cached_gguf_model(a.path, tmp_path / "cache", accuracy_level=4) != one
    assert cached_gguf_model(a.path, tmp_path / "cache", accuracy_level=1) == one  # 1 is the default


def test_an_unfinished_entry_is_rebuilt(tmp_path: Path) -> None:
    g = write_gguf(tmp_path / "a.gguf", Spec(qtype=T.Q4_0))
    done = cached_gguf_model(g.path, tmp_path / "cache")
    (done / DONE).unlink()  # as an interrupted conversion from before atomic renames would leave it
    (done / "model.onnx").write_text("truncated")
    again = cached_gguf_model(g.path, tmp_path / "cache")
    assert again == done and (again / DONE).is_file() and (again / "model.onnx").stat().st_size > 100


def test_a_failed_conversion_leaves_nothing_in_the_cache(tmp_path: Path) -> None:
    g = write_gguf(tmp_path / "a.gguf", Spec(qtype=T.IQ4_NL))
    with pytest.raises(onnxgen.convert.GGUFConversionError):
        cached_gguf_model(g.path, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_the_default_cache_root_follows_onnxgens_cache_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (conversions go to cache_home() / "gguf", beside the prepared graphs and the pulled models)
    monkeypatch.setenv("ONNXGEN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_home() == tmp_path / "mine"
    monkeypatch.delenv("ONNXGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_home() == tmp_path / "xdg" / "onnxgen"
