"""``--chat-template FILE`` on generate, chat and serve (and ``load(chat_template=...)``), and a model without
a chat template told so when it loads for a chat, not at the first message."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from onnxgen.cli import main
from onnxgen.errors import TokenizerError
from onnxgen.llm import load
from onnxgen.serving.engine import EngineSpec, load_app
from onnxgen.testing import build_model
from onnxgen.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"
CHAT = [{"role": "user", "content": "Hi there"}]
PROMPT_TOKENS = re.compile(r"prompt (\d+) tokens")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("template") / "dense", "genai-dense")


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with no chat template in its files."""
    out = build_model(tmp_path_factory.mktemp("untemplated") / "dense", "genai-dense")
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "template.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def expected(model: Path) -> list[int]:
    """The token ids of CHAT rendered by TEMPLATE (by hand: the text the template writes)."""
    return Tokenizer.from_dir(model).encode("<<user: Hi there>>", add_special_tokens=False)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)


def test_load_with_a_chat_template_renders_chats_with_it(model: Path, expected: list[int]) -> None:
    own = load(model, threads=1)
    assert own.chat_prompt(CHAT) != expected  # the control: the model's ChatML template
    assert load(model, threads=1, chat_template=TEMPLATE).chat_prompt(CHAT) == expected


def test_generate_chat_template_changes_the_rendered_prompt(
    model: Path, template_file: Path, expected: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", str(model), "Hi there", "--chat", "-n", "1", "--temp", "0", "--json", "--no-stream"]
    assert main(argv) == 0
    own = json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"]
    assert main([*argv, "--chat-template", str(template_file)]) == 0
    given = json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"]
    assert given == len(expected) != own


def test_chat_uses_the_chat_template_given(
    untemplated: Path,
    template_file: Path,
    expected: list[int],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\n"))
    argv = [
        "chat",
        str(untemplated),
        "-n",
        "1",
        "--temp",
        "0",
        "--stats",
        "--chat-template",
        str(template_file),
    ]
    assert main(argv) == 0
    assert PROMPT_TOKENS.findall(capsys.readouterr().err) == [str(len(expected))]


def test_a_model_without_a_chat_template_is_told_at_load_not_at_the_first_message(
    untemplated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no message at all: only the load can fail
    assert main(["chat", str(untemplated), "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnxgen chat: error: no chat template found") and err.count("\n") == 0
    assert "pass --chat-template FILE" in err
    assert main(["generate", str(untemplated), "Hi", "--chat", "-n", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no chat template found" in err and "--chat-template FILE" in err
    assert main(["generate", str(untemplated), "Hi", "-n", "1"]) == 0  # a plain prompt needs no template


def test_a_chat_template_that_does_not_compile_or_cannot_be_read_is_one_line(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    assert main(["generate", str(model), "Hi", "--chat", "--chat-template", str(broken)]) == 2
    assert "the chat template does not compile" in capsys.readouterr().err
    assert main(["generate", str(model), "Hi", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err
    with pytest.raises(TokenizerError, match="does not compile"):
        load(model, threads=1, chat_template="{% if %}")


def test_serve_renders_chats_with_the_chat_template_given_and_warns_without_one(
    model: Path, untemplated: Path, expected: list[int]
) -> None:
    said: list[str] = []
    app, _ = load_app(EngineSpec(str(model), threads=1, min_rows=1, chat_template=TEMPLATE), said.append)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        body = {"messages": CHAT, "add_generation_prompt": False, "add_special_tokens": False}
        assert client.post("/tokenize", json=body).json()["tokens"] == expected
    assert not any("no chat template" in line for line in said)
    load_app(EngineSpec(str(untemplated), threads=1, min_rows=1), said.append)
    assert any("no chat template" in line and "--chat-template FILE" in line for line in said)
