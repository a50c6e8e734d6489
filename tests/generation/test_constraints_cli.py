"""``onnxgen generate --json-schema FILE | --regex RE | --grammar FILE``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from onnxgen.cli import main
from onnxgen.testing import build_model

PROMPT = "the quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_model(tmp_path_factory.mktemp("cli"), "genai-dense"))


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)
    monkeypatch.delenv("ONNXGEN_THREADS", raising=False)


def run(model: str, *flags: str) -> list[str]:
    return ["generate", model, PROMPT, "--threads", "1", "--temp", "1", "--seed", "4", "-n", "60", *flags]


def test_json_schema_from_a_file_gives_json_valid_under_it(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert main(run(model, "--json-schema", str(schema_file), "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    value = json.loads(result["text"])
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert result["finish_reason"] == "stop"


def test_an_inline_json_schema_is_accepted(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run(model, "--json-schema", json.dumps(SCHEMA), "--no-stats")) == 0
    value = json.loads(capsys.readouterr().out)
    assert set(value) == {"n", "ok"}


def test_regex_output_matches_in_full(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run(model, "--regex", "[a-z]{3}-[0-9]{2}")) == 0
    captured = capsys.readouterr()
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}\n", captured.out)
    assert "finish stop" in captured.err


def test_grammar_from_a_file(model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grammar = tmp_path / "greeting.lark"
    grammar.write_text('start: ("hi" | "hello") " " NAME "!"\nNAME: /[A-Z][a-z]{1,5}/\n')
    assert main(run(model, "--grammar", str(grammar), "--no-stats")) == 0
    assert re.fullmatch(r"(hi|hello) [A-Z][a-z]{1,5}!\n", capsys.readouterr().out)


def test_two_constraint_flags_are_refused(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(run(model, "--regex", "a", "--grammar", "g.lark"))
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (("--regex", "(unclosed"), ("regex does not compile", "unclosed group")),
        (("--grammar", "/no/such/file.lark"), ("--grammar", "cannot be read")),
        (("--json-schema", "/no/such/schema.json"), ("--json-schema", "cannot be read")),
        (("--json-schema", '{"type": "nonsense"}'), ("json_schema does not compile", "nonsense")),
    ],
)
def test_a_bad_constraint_is_one_error_line(
    model: str, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    assert main(run(model, *flags)) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    for needle in needles:
        assert needle in err
