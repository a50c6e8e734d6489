"""``onnxgen --help``, ``--version`` and usage errors answer before onnx / onnxruntime are imported; Ctrl-C
while a command starts ends it with exit 130 and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import onnxgen
from onnxgen.cli import COMMANDS, main

SRC = str(Path(onnxgen.__file__).resolve().parent.parent)
HEAVY = ("onnx", "onnxruntime", "numpy", "onnx_ir", "tokenizers")


def _modules_after(argv: list[str]) -> tuple[int, set[str], str]:
    """Run ``main(argv)`` in a fresh interpreter; its exit code, which heavy modules it imported, stdout."""
    code = (
        "import sys\nfrom onnxgen.cli import main\n"
        f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
        f"print('MODULES', rc, *sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC}, check=False
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("MODULES"))
    _, rc, *mods = line.split()
    return int(rc), set(mods), out


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["generate", "--help"],
        ["chat", "--help"],
        ["serve", "--help"],
        ["inspect", "--help"],
        ["bench", "--help"],
        ["export-mtp", "--help"],
        ["pull", "--help"],
        ["pull"],  # usage error: no name
        ["convert", "--help"],
        ["generate"],  # usage error: no prompt
        ["generate", "hi", "--bogus"],
        ["nonsense"],
    ],
)
def test_help_version_and_usage_errors_import_no_runtime(argv: list[str]) -> None:
    rc, mods, out = _modules_after(argv)
    assert rc == (0 if argv[-1] in ("--help", "--version") else 2)
    assert not mods, f"{argv} imported {mods}"
    if argv == ["--version"]:
        assert f"onnxgen {onnxgen.__version__}" in out
    if argv == ["--help"]:
        assert all(name in out for name in COMMANDS)


def test_ctrl_c_while_a_command_starts_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("onnxgen.llm.load", interrupted)
    assert main(["generate", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_the_public_names_resolve_lazily_and_are_listed() -> None:
    code = (
        "import sys, onnxgen\nassert 'onnxruntime' not in sys.modules\n"
        "print(onnxgen.SamplingParams(max_new_tokens=3).max_new_tokens, 'LLM' in dir(onnxgen))\n"
        "print(onnxgen.load.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC}, check=True
    ).stdout.split()
    assert out == ["3", "True", "onnxgen.llm"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        onnxgen.nope  # noqa: B018


def test_a_load_and_a_generation_from_token_ids_import_no_server_template_or_grammar_library() -> None:
    """What a load does not need is imported where it is used: the server's stack, jinja2 (chat templates),
    llguidance (constraints), yaml (inference_metadata.yaml), onnx-ir (Scan graphs only)."""
    lazy = ("fastapi", "starlette", "pydantic", "uvicorn", "jinja2", "llguidance", "yaml", "onnx_ir", "torch")
    code = (
        "import sys, onnxgen\nllm = onnxgen.load(threads=1)\n"
        "llm.generate([1, 2, 3], max_new_tokens=2)\n"
        f"print('MODULES', *sorted(m for m in {lazy!r} if m in sys.modules))\n"
        "llm.chat([{'role': 'user', 'content': 'hi'}], max_new_tokens=1)\n"
        "llm.generate('a', max_new_tokens=2, regex='[0-9]+')\n"
        "print('AFTER', *sorted(m for m in ('jinja2', 'llguidance') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC}, check=True
    ).stdout.splitlines()
    assert next(line for line in out if line.startswith("MODULES")) == "MODULES"
    assert next(line for line in out if line.startswith("AFTER")) == "AFTER jinja2 llguidance"
