"""The command line as llama.cpp and ollama users type it: ``-t`` is threads, ``-s`` the seed, their long
spellings (``--temp``, ``--n-predict``, ``--repeat-penalty``, ``-c``), a model given without a prompt,
unknown flags answered with the command's usage and the closest flag, ``validate --self`` on the default
model, and chat's ``/bye``, ``/clear`` and ``/set``."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from onnxgen.cli import build_parser, main
from onnxgen.cli.generate import SAMPLING_DEFAULTS, sampling_params
from onnxgen.generation.generator import StreamEvent
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import LLM, load
from onnxgen.testing import build_model

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("habits"), "genai-dense")


@pytest.fixture(scope="module")
def dense_llm(dense_dir: Path) -> LLM:
    return load(dense_dir, threads=1)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)
    monkeypatch.delenv("ONNXGEN_THREADS", raising=False)


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["generate", "m", "p", *argv])


# -- flags ------------------------------------------------------------------------------------------
def test_dash_t_is_threads_and_dash_s_the_seed_as_in_llama_cpp() -> None:
    # `onnxgen generate "def add(a, b):" -t 4 -s 42`
    args = _args("-t", "4", "-s", "42")
    assert args.threads == 4 and args.seed == 42
    params = sampling_params(args, SAMPLING_DEFAULTS)
    assert params.temperature == SAMPLING_DEFAULTS["temperature"]  # -t left the temperature alone
    assert params.seed == 42
    assert not hasattr(args, "system") or args.system is None  # -s is no system message


def test_generate_with_dash_t_and_dash_s_samples_with_that_seed_on_that_many_threads(
    dense_dir: Path, dense_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    # `onnxgen generate MODEL "the quick brown fox" -t 1 -s 42 -n 6`: llama.cpp's meaning of both
    expected = dense_llm.generate(PROMPT, SamplingParams(**SAMPLING_DEFAULTS, seed=42, max_new_tokens=6))
    other_seed = dense_llm.generate(PROMPT, SamplingParams(**SAMPLING_DEFAULTS, seed=7, max_new_tokens=6))
    assert expected.text != other_seed.text  # the seed matters here, so the comparison can fail
    assert main(["generate", str(dense_dir), PROMPT, "-t", "1", "-s", "42", "-n", "6", "--no-stats"]) == 0
    assert capsys.readouterr().out == expected.text + "\n"


@pytest.mark.parametrize(
    ("llama", "ours"),
    [
        (["--temp", "0.3"], ["--temperature", "0.3"]),
        (["--n-predict", "9"], ["--max-new-tokens", "9"]),
        (["--repeat-penalty", "1.3"], ["--repetition-penalty", "1.3"]),
        (["-s", "5"], ["--seed", "5"]),
    ],
)
def test_llama_cpp_spellings_give_the_same_sampling_params(llama: list[str], ours: list[str]) -> None:
    assert sampling_params(_args(*llama), SAMPLING_DEFAULTS) == sampling_params(
        _args(*ours), SAMPLING_DEFAULTS
    )
    assert sampling_params(_args(*llama), SAMPLING_DEFAULTS) != sampling_params(_args(), SAMPLING_DEFAULTS)


def test_serve_takes_c_and_ctx_size_as_max_model_len() -> None:
    for flag in ("-c", "--ctx-size", "--max-model-len"):
        assert build_parser().parse_args(["serve", "m", flag, "128"]).max_model_len == 128
    for command in ("chat", "serve", "bench", "inspect"):
        assert build_parser().parse_args([command, "m", "-t", "3"]).threads == 3


def test_a_model_directory_or_file_without_a_prompt_is_an_error_not_the_prompt(
    dense_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `onnxgen generate MODEL -n 8`: the prompt forgotten
    for model in (dense_dir, dense_dir / "model.onnx"):
        assert main(["generate", str(model), "-n", "8"]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert "onnxgen generate: error: no prompt given" in captured.err and str(model) in captured.err


def test_a_prompt_that_is_no_path_still_runs_on_the_default_model(
    dense_dir: Path, dense_llm: LLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ONNXGEN_MODEL", str(dense_dir))
    expected = dense_llm.generate("model.onnx", SamplingParams(max_new_tokens=4)).text  # no such file here
    assert main(["generate", "model.onnx", "-n", "4", "--temp", "0", "--no-stats"]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (
            ["generate", "m", "p", "--max-tokens", "5"],
            "usage: onnxgen generate",
            "did you mean --max-new-tokens?",
        ),
        (["chat", "m", "--temprature", "0"], "usage: onnxgen chat", "did you mean --temperature?"),
        (["serve", "m", "--api_key", "k"], "usage: onnxgen serve", "did you mean --api-key?"),
    ],
)
def test_an_unknown_flag_prints_the_commands_usage_and_the_closest_flag(
    argv: list[str], usage: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and hint in err
    assert "onnxgen [-h] [--version] COMMAND" not in err


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["generate", "-m", "m", "-p", "hi"], "the model is the first argument"),
        (["generate", "m", "hi", "-c", "4096"], "the context size is the server's (onnxgen serve -c N)"),
        (["chat", "m", "-ngl", "99"], "no GPU layers"),
    ],
)
def test_llama_cpp_flags_a_command_lacks_say_what_to_do_instead(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert hint in capsys.readouterr().err


def test_a_flag_like_nothing_gets_no_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "m", "p", "--zzzzqqq"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzqqq" in err and "did you mean" not in err


def test_validate_self_without_a_model_checks_the_default_model(
    dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n")
    flags = ["--self", "--new-tokens", "2", "--prompts", str(prompts), "--threads", "1", "--json"]
    assert main(["validate", str(dense_dir), *flags]) == 0
    named = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("ONNXGEN_MODEL", str(dense_dir))
    assert main(["validate", *flags]) == 0  # `onnxgen validate --self`
    assert json.loads(capsys.readouterr().out)["prompts"] == named["prompts"]


# -- chat -------------------------------------------------------------------------------------------
@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[dict[str, Any]], SamplingParams]]:
    """The messages and sampling params of every turn the REPL sends to the model."""
    calls: list[tuple[list[dict[str, Any]], SamplingParams]] = []
    real = LLM.stream_chat

    def spy(
        self: LLM, messages: Sequence[Mapping[str, Any]], params: Any = None, speculative: Any = None
    ) -> Iterator[StreamEvent]:
        calls.append(([dict(m) for m in messages], params))
        return real(self, messages, params, speculative)

    monkeypatch.setattr(LLM, "stream_chat", spy)
    return calls


def _chat(monkeypatch: pytest.MonkeyPatch, model: Path, lines: str, *flags: str) -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    return main(["chat", str(model), "-n", "4", "--threads", "1", *flags])


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_chat_bye_leaves_and_clear_forgets_as_in_ollama(
    dense_dir: Path, turns: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _chat(monkeypatch, dense_dir, "hi\n/clear\nagain\n/bye\nnever sent\n", "--temp", "0") == 0
    assert [messages for messages, _ in turns] == [[_user("hi")], [_user("again")]]
    assert "cleared" in capsys.readouterr().err


def test_chat_set_temperature_0_makes_the_next_turns_greedy(
    dense_dir: Path, turns: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = "one\n/set temperature 0\ntwo\n/set parameter top_k 7\n/set num_predict 3\nthree\n"
    assert _chat(monkeypatch, dense_dir, lines) == 0
    [(_, first), (_, second), (_, third)] = turns
    assert first.temperature == SAMPLING_DEFAULTS["temperature"] and first.top_k == SAMPLING_DEFAULTS["top_k"]
    assert second == SamplingParams(max_new_tokens=4)  # as `--temp 0`: greedy without the default filters
    assert third == SamplingParams(max_new_tokens=3, top_k=7)
    assert "/set" not in "".join(str(m) for m, _ in turns)  # the commands never reach the model


def test_chat_set_system_and_bad_set_values_are_answered_not_sent(
    dense_dir: Path, turns: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = "/set system be brief\n/set temperature hot\n/set num_ctx 9\n/x\n/show info\nhi\n"
    assert _chat(monkeypatch, dense_dir, lines, "--temp", "0") == 0
    assert [m for m, _ in turns] == [[{"role": "system", "content": "be brief"}, _user("hi")]]
    err = capsys.readouterr().err
    assert "/set temperature takes a number (got 'hot')" in err
    assert "/set knows" in err and "'num_ctx'" in err
    assert "unknown command /x" in err and "unknown command /show" in err
