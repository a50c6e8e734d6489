"""``onnxgen serve`` startup: flag errors, a port in use and a broken export are one line on stderr and
exit code 2 (the first two before any model is loaded); what it prints while starting and per request."""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import pytest
from server_helpers import ServerProcess, free_port

from onnxgen.cli.serve import main
from onnxgen.testing import build_model, poison_weights


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["/nonexistent-model-dir"], "/nonexistent-model-dir does not exist"),
        (["/nonexistent-model-dir", "--port", "70000"], "--port must be in [0, 65535] (got 70000)"),
        (
            ["/nonexistent-model-dir", "--min-batch-rows", "0"],
            "--min-batch-rows must be 'auto' or an integer >= 1",
        ),
        (["/nonexistent-model-dir", "--prefill-chunk", "1"], "prefill_chunk must be an integer >= 2 (got 1)"),
        (["/nonexistent-model-dir", "--api-key", " "], "the API key is empty"),
        (["/nonexistent-model-dir", "--tool-call-parser", "nope"], "unknown tool-call parser 'nope'"),
    ],
)
def test_a_bad_serve_flag_or_model_is_one_error_line_and_exit_code_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnxgen serve: error: ") and says in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--replicas", "2"], "--replicas only apply with --ray; add --ray or drop them"),
        (["--address", "auto", "--max-replicas", "3"], "--max-replicas, --address only apply with --ray"),
        (
            ["--ray", "--replicas", "2", "--min-replicas", "1"],
            "give either --replicas N (fixed) or --min-replicas/--max-replicas (autoscaling), not both",
        ),
    ],
)
def test_scale_out_flags_without_ray_or_mixed_are_one_error_line_before_ray_starts(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from onnxgen.llm import default_model_dir

    assert main([str(default_model_dir()), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnxgen serve: error: ") and says in err
    assert len(err.splitlines()) == 1


def test_ray_without_ray_serve_installed_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from onnxgen.llm import default_model_dir

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "onnxgen.serving.ray", raising=False)
    assert main([str(default_model_dir()), "--ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnxgen serve: error: --ray needs Ray Serve")
    assert err.endswith("install it with: pip install 'onnxgen[ray]'") and len(err.splitlines()) == 1


def test_a_port_in_use_fails_before_the_model_loads(
    server_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        assert main([str(server_models["genai-dense"]), "--port", str(port), "--threads", "1"]) == 2
        elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"onnxgen serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); stop what uses the port or pick another with --port"
    )
    assert elapsed < 2.0  # nothing was loaded


def test_an_export_computing_nan_is_refused_at_startup_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = poison_weights(build_model(tmp_path / "nan", "genai-dense"))
    assert main([str(model), "--port", str(free_port()), "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"onnxgen serve: loading {model}"
    assert err[-1].startswith(
        f"onnxgen serve: error: the export {model / 'model.onnx'} computed non-finite logits"
    )
    assert not any("listening" in line for line in err)


def test_startup_says_loading_then_loaded_with_its_time_then_listening_and_logs_prompts_when_asked(
    server_models: dict[str, Path], tmp_path: Path
) -> None:
    server = ServerProcess(server_models["genai-dense"], tmp_path / "server.log", "--log-prompts")
    try:
        server.http.post("/v1/completions", json={"prompt": "the zebra-unicorn", "max_tokens": 3})
        time.sleep(0.2)
        lines = server.log().splitlines()
    finally:
        server.close()
    model = server_models["genai-dense"]
    assert lines[0] == f"onnxgen serve: loading {model}"
    assert re.fullmatch(r"onnxgen serve: loaded genai-dense in \d+\.\d s", lines[1]), lines[1]
    assert lines[2] == (
        "onnxgen serve: tool calls are read as hermes (the default: the chat template shows no tool-call format)"
    )
    assert lines[3].startswith(f"onnxgen serve: listening on http://127.0.0.1:{server.port} (batch 16")
    request = next(line for line in lines if "POST /v1/completions" in line)
    assert re.fullmatch(
        r"onnxgen serve: POST /v1/completions 200 tokens=\d+\+3 [\d.]+ ms prompt='the zebra-unicorn'", request
    ), request
