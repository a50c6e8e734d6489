"""EngineConfig: validated settings, the environment read in one place (its on/off switches one way),
and clear refusals naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

import onnxgen
from onnxgen.config import FAST_OPS, FUSE, HUGE_PAGES, SWITCHES, THREADS, EngineConfig, env_switch
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
    assert onnxgen.load(int4_dense, threads=2).session.fusions.rewritten
    monkeypatch.setenv(FUSE, "off")
    monkeypatch.setenv(HUGE_PAGES, "no")
    llm = onnxgen.load(int4_dense, threads=2)
    assert not llm.session.fusions.rewritten and not llm.session._huge_pages
    assert onnxgen.load(int4_dense, threads=2, fuse=True).session.fusions.rewritten


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


def test_from_env_reads_every_setting_and_keywords_win(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SWITCHES:
        monkeypatch.setenv(name, "off")
    monkeypatch.setenv(THREADS, " 3 ")
    config = EngineConfig.from_env()
    assert (config.threads, config.fuse, config.fast_ops, config.huge_pages) == (3, False, False, False)
    mixed = EngineConfig.from_env(threads=1, fuse=True, fast_ops=None)  # None: not given, the env's stays
    assert (mixed.threads, mixed.fuse, mixed.fast_ops) == (1, True, False)
    for name in (*SWITCHES, THREADS):
        monkeypatch.delenv(name)
    assert EngineConfig.from_env() == EngineConfig()


@pytest.mark.parametrize("raw", ["many", "0", "-2"])
def test_a_bad_thread_count_in_the_environment_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(THREADS, raw)
    with pytest.raises(SettingError, match=rf"\$ONNXGEN_THREADS must be an integer >= 1 \(got '{raw}'\)"):
        EngineConfig.from_env()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"threads": 0}, "threads must be an integer >= 1 or None (got 0)"),
        ({"threads": True}, "threads must be an integer >= 1 or None (got True)"),
        ({"decode_plan": "fast"}, "decode_plan must be one of auto, scan, inline (got 'fast')"),
        ({"fuse": "yes"}, "fuse must be True, False or None"),
        ({"exact_speculation": "always"}, "exact_speculation must be True, False or None"),
        ({"speculative": 1}, "speculative must be True or False (got 1)"),
        ({"providers": "CPUExecutionProvider"}, "providers must be a sequence of execution provider names"),
        ({"max_batch": 0}, "max_batch must be an integer >= 1 (got 0)"),
        ({"prefill_chunk": 1}, "prefill_chunk must be an integer >= 2 (got 1)"),
        ({"max_model_len": 1}, "max_model_len must be an integer >= 2 or None (got 1)"),
        ({"min_rows": 0}, "min_rows must be an integer >= 1 or None (got 0)"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(settings: dict[str, object], message: str) -> None:
    with pytest.raises(SettingError) as raised:
        EngineConfig(**settings)  # type: ignore[arg-type]
    assert message in str(raised.value)
    with pytest.raises(SettingError):
        EngineConfig().replace(**settings)


def test_the_config_is_frozen_and_providers_become_a_tuple() -> None:
    config = EngineConfig().replace(providers=["CPUExecutionProvider"])
    assert config.providers == ("CPUExecutionProvider",)
    with pytest.raises(AttributeError):
        config.threads = 2  # type: ignore[misc]


def test_load_takes_the_config_or_its_fields_by_name(int4_dense: Path) -> None:
    with pytest.raises(SettingError, match=r"unknown engine setting thread; the settings are threads, "):
        onnxgen.load(int4_dense, thread=1)
    with pytest.raises(SettingError, match="decode_plan must be one of"):
        onnxgen.load(int4_dense, decode_plan="fastest")
    llm = onnxgen.load(int4_dense, EngineConfig(threads=1, fuse=False), huge_pages=False)
    assert llm.config == EngineConfig(threads=1, fuse=False, huge_pages=False)
    assert llm.session.threads == 1 and not llm.session.fusions.rewritten and not llm.session._huge_pages


def spinning_entry(llm: onnxgen.LLM) -> str | None:
    """The session's ``allow_spinning`` config entry (None: not set, onnxruntime spins)."""
    options = llm.session.session.get_session_options()
    try:
        return options.get_session_config_entry("session.intra_op.allow_spinning")
    except RuntimeError:  # onnxruntime raises where the entry was never set
        return None


def test_spinning_off_reaches_the_session_and_keeps_the_tokens(
    int4_dense: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spinning=False (or ONNXGEN_SPINNING=off) sets onnxruntime's entry; the default leaves it unset; the
    threads only wait differently, so greedy tokens stay the same."""
    from onnxgen import SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    spinning = onnxgen.load(int4_dense, threads=2)
    assert spinning_entry(spinning) in (None, "1")
    sleeping = onnxgen.load(int4_dense, threads=2, spinning=False)
    assert spinning_entry(sleeping) == "0"
    assert sleeping.generate([5, 6, 7], params).token_ids == spinning.generate([5, 6, 7], params).token_ids
    monkeypatch.setenv("ONNXGEN_SPINNING", "off")
    assert spinning_entry(onnxgen.load(int4_dense, threads=2)) == "0"
    assert spinning_entry(onnxgen.load(int4_dense, threads=2, spinning=True)) in (None, "1")


def test_serve_no_spinning_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``onnxgen serve --no-spinning`` sets the spec's and so the engine's setting; without it the
    environment's switch decides."""
    from onnxgen.cli import build_parser
    from onnxgen.serving.engine import EngineSpec

    monkeypatch.delenv("ONNXGEN_SPINNING", raising=False)
    assert build_parser().parse_args(["serve", "m", "--no-spinning"]).spinning is False
    assert build_parser().parse_args(["serve", "m"]).spinning is None
    assert EngineSpec("m", spinning=False).engine_config().spinning is False
    assert EngineSpec("m").engine_config().spinning is None
    monkeypatch.setenv("ONNXGEN_SPINNING", "0")
    assert EngineSpec("m").engine_config().spinning is False
