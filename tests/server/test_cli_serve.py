"""``onnxgen serve`` flags: user errors are one line on stderr and exit code 2, before any model is loaded."""

from __future__ import annotations

import pytest

from onnxgen.cli_serve import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["/nonexistent-model-dir"], "/nonexistent-model-dir does not exist"),
        (["/nonexistent-model-dir", "--port", "70000"], "--port must be in [0, 65535] (got 70000)"),
        (
            ["/nonexistent-model-dir", "--min-batch-rows", "0"],
            "--min-batch-rows must be 'auto' or an integer >= 1",
        ),
    ],
)
def test_a_bad_serve_flag_or_model_is_one_error_line_and_exit_code_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnxgen serve: error: ") and says in err
    assert len(err.splitlines()) == 1
