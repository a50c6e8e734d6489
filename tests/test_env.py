"""The environment's on/off switches (onnxgen.env): one reading for all of them, and a clear refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

import onnxgen
from onnxgen.env import FAST_OPS, FUSE, HUGE_PAGES, SWITCHES, env_switch
from onnxgen.errors import SettingError
from onnxgen.testing import build_model


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_on_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(FUSE, value)
    assert env_switch(FUSE) is True


@pytest.mark.parametrize("value", ["0", "False", "no", "OFF "])
def test_off_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(FUSE, value)
    assert env_switch(FUSE) is False


def test_unset_or_empty_leaves_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FUSE, raising=False)
    assert env_switch(FUSE) is None
    monkeypatch.setenv(FUSE, "  ")
    assert env_switch(FUSE) is None


def test_anything_else_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HUGE_PAGES, "enabled")
    with pytest.raises(SettingError, match=r"ONNXGEN_HUGE_PAGES='enabled' is not an on/off value.*unset it"):
        env_switch(HUGE_PAGES)


@pytest.fixture(scope="module")
def int4_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m"), "genai-dense", precision="int4")


def test_every_switch_takes_the_same_words(int4_dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each switch takes "off" as it takes "0" (ONNXGEN_FUSE once took only "0"); keywords still win."""
    assert onnxgen.load(int4_dense, threads=1).session.fusions.rewritten
    monkeypatch.setenv(FUSE, "off")
    monkeypatch.setenv(HUGE_PAGES, "no")
    llm = onnxgen.load(int4_dense, threads=1)
    assert not llm.session.fusions.rewritten and not llm.session._huge_pages
    assert onnxgen.load(int4_dense, threads=1, fuse=True).session.fusions.rewritten


@pytest.mark.parametrize("name", SWITCHES)
def test_a_bad_switch_fails_the_load_even_where_the_model_would_not_read_it(
    int4_dense: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """FAST_OPS only concerns hybrids; a typo in it still stops a dense model's load, with its name."""
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(SettingError, match=name):
        onnxgen.load(int4_dense, threads=1)


def test_the_cli_prints_the_refusal_as_one_line(
    int4_dense: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from onnxgen.cli import main

    monkeypatch.setenv(FAST_OPS, "2")
    assert main(["generate", str(int4_dense), "hi", "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert "ONNXGEN_FAST_OPS='2' is not an on/off value" in err and "Traceback" not in err
