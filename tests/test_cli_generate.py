"""``onnxgen generate``: same tokens as the library, streaming per event, JSON, stats, flags and errors."""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from onnxgen.cli import build_parser, main
from onnxgen.cli.generate import sampling_params
from onnxgen.errors import GenerationError
from onnxgen.generation.generator import StreamEvent
from onnxgen.generation.params import SamplingParams
from onnxgen.generation.speculative.budget import DraftBudget
from onnxgen.llm import LLM, load
from onnxgen.testing import build_model, poison_weights

PROMPT = "the quick brown fox"
STATS = re.compile(
    r"prompt (\d+) tokens \| generated (\d+) tokens \| TTFT ([\d.]+) ms \| decode ([\d.]+) tok/s \| finish (\w+)"
)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("dense"), "genai-dense")


@pytest.fixture(scope="module")
def dense_llm(dense_dir: Path) -> LLM:
    return load(dense_dir, threads=1)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONNXGEN_MODEL", raising=False)
    monkeypatch.delenv("ONNXGEN_THREADS", raising=False)


def _one_line_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0, err
    assert err.startswith("onnxgen generate: error: ")
    for needle in needles:
        assert needle in err


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-mobius"])
@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_generate_prints_the_greedy_text_the_library_generates(
    tmp_path: Path, family: str, stream: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = build_model(tmp_path / family, family)
    expected = load(model, threads=1).generate(PROMPT, SamplingParams(max_new_tokens=12))
    assert main(["generate", str(model), PROMPT, "-n", "12", "--temp", "0", "--threads", "1", stream]) == 0
    out = capsys.readouterr().out
    assert out == expected.text + "\n"


def test_generate_json_prints_one_object_with_text_ids_finish_reason_and_stats(
    dense_dir: Path, dense_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = dense_llm.generate(PROMPT, SamplingParams(max_new_tokens=9))
    assert main(["generate", str(dense_dir), PROMPT, "-n", "9", "--temp", "0", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert result["token_ids"] == expected.token_ids and result["text"] == expected.text
    assert result["finish_reason"] == expected.finish_reason
    assert result["stats"]["prompt_tokens"] == len(dense_llm.encode(PROMPT))
    assert result["stats"]["generated_tokens"] == len(expected.token_ids)
    assert captured.err == ""


class _RecordingStdout(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1


def test_generate_writes_and_flushes_each_event_before_asking_for_the_next(
    dense_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stdout = _RecordingStdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    texts: list[str] = []
    printed_before_next: list[str] = []
    real_stream = LLM.stream

    def spy(
        self: LLM, prompt: object, params: SamplingParams | None = None, speculative: object = None
    ) -> Iterator[StreamEvent]:
        for event in real_stream(self, prompt, params, speculative):  # type: ignore[arg-type]
            texts.append(event.text)
            yield event
            printed_before_next.append(stdout.getvalue())

    monkeypatch.setattr(LLM, "stream", spy)
    assert (
        main(["generate", str(dense_dir), PROMPT, "-n", "10", "--temp", "0", "--ignore-eos", "--no-stats"])
        == 0
    )
    # (the stream is drained after its last event: a chat stream caches the next turn's opening then)
    assert len(texts) == 10 and len(printed_before_next) == 10
    for i, printed in enumerate(printed_before_next):
        assert printed == "".join(texts[: i + 1])
    assert len({p for p in printed_before_next if p}) >= 2  # text really grew during generation
    assert stdout.flushes >= sum(1 for t in texts if t)
    assert stdout.getvalue() == "".join(texts) + "\n"


def test_generate_prints_a_stats_line_with_counts_timing_and_finish_reason_on_stderr(
    dense_dir: Path, dense_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", str(dense_dir), PROMPT, "-n", "7", "--temp", "0", "--ignore-eos"]) == 0
    err = capsys.readouterr().err.strip()
    match = STATS.search(err)
    assert match is not None, err
    assert int(match[1]) == len(dense_llm.encode(PROMPT))
    assert int(match[2]) == 7
    assert float(match[3]) > 0 and float(match[4]) > 0
    assert match[5] == "length"


def test_generate_chat_and_system_wrap_the_prompt_in_the_chat_template(
    dense_dir: Path, dense_llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    params = SamplingParams(max_new_tokens=8)
    chat = dense_llm.chat([{"role": "user", "content": PROMPT}], params).text
    with_system = dense_llm.chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}], params
    ).text
    plain = dense_llm.generate(PROMPT, params).text
    assert chat != plain  # the template changes the prompt, so the check below can fail
    assert main(["generate", str(dense_dir), PROMPT, "-n", "8", "--temp", "0", "--chat", "--no-stats"]) == 0
    assert capsys.readouterr().out == chat + "\n"
    assert (
        main(
            [
                "generate",
                str(dense_dir),
                PROMPT,
                "-n",
                "8",
                "--temp",
                "0",
                "--system",
                "be brief",
                "--no-stats",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == with_system + "\n"


def test_generate_with_one_positional_takes_the_model_from_env_then_the_bundled_default(
    dense_dir: Path, dense_llm: LLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = dense_llm.generate(PROMPT, SamplingParams(max_new_tokens=6)).text
    monkeypatch.setenv("ONNXGEN_MODEL", str(dense_dir))
    assert main(["generate", PROMPT, "-n", "6", "--temp", "0", "--no-stats"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    monkeypatch.delenv("ONNXGEN_MODEL")
    monkeypatch.setattr("onnxgen.llm.default_model_dir", lambda: dense_dir)
    assert main(["generate", PROMPT, "-n", "6", "--temp", "0", "--no-stats"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_generate_accepts_options_between_model_and_prompt_and_a_prompt_from_stdin(
    dense_dir: Path, dense_llm: LLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = dense_llm.generate(PROMPT, SamplingParams(max_new_tokens=5)).text
    assert main(["generate", str(dense_dir), "-n", "5", "--temp", "0", PROMPT, "--no-stats"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    assert main(["generate", str(dense_dir), "-", "-n", "5", "--temp", "0", "--no-stats"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_every_sampling_flag_reaches_sampling_params() -> None:
    flags = (
        "-n 33 --temp 0.7 --top-k 5 --top-p 0.9 --min-p 0.05 --repetition-penalty 1.2 --presence-penalty 0.5"
    )
    flags += " --frequency-penalty -0.5 --seed 7 --stop a --stop bc --ignore-eos --min-new-tokens 3"
    args = build_parser().parse_args(["generate", "m", "p", *flags.split()])
    assert sampling_params(args) == SamplingParams(
        max_new_tokens=33,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=7,
        stop=("a", "bc"),
        ignore_eos=True,
        min_new_tokens=3,
    )
    assert sampling_params(build_parser().parse_args(["generate", "p"])) == SamplingParams()


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--temp", "-1"], ["--temperature", "-1"]),
        (["--top-p", "0"], ["--top-p", "(0, 1]"]),
        (["--threads", "0"], ["--threads", ">= 1"]),
        (["-n", "2", "--min-new-tokens", "5"], ["--min-new-tokens"]),
    ],
)
def test_generate_rejects_bad_values_with_one_line_and_exit_2(
    dense_dir: Path, flags: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", str(dense_dir), PROMPT, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    _one_line_error(captured.err, *needles)


def test_generate_reports_a_bad_threads_env_var_and_a_missing_model_in_one_line(
    dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ONNXGEN_THREADS", "many")
    assert main(["generate", str(dense_dir), PROMPT]) == 2
    _one_line_error(capsys.readouterr().err, "$ONNXGEN_THREADS", "'many'")
    monkeypatch.delenv("ONNXGEN_THREADS")
    monkeypatch.setattr("onnxgen.llm.default_model_dir", lambda: tmp_path / "absent")
    assert main(["generate", PROMPT]) == 2
    _one_line_error(capsys.readouterr().err, "bundled default model is missing", "ONNXGEN_MODEL")


# -- speculative decoding ---------------------------------------------------------------------------
REPEATING = "def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add("
DRAFTS = re.compile(r"\| drafts (\d+)/(\d+) accepted \| (\d+) target forwards \(([\d.]+) tokens/forward\)")


def _json_run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["generate", *argv, "--json", "--threads", "1", "--temp", "0"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-mobius"])
def test_generate_with_prompt_lookup_gives_the_plain_greedy_tokens_and_states_its_drafts(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the draft length's cost cap follows measured times: two runs may draft differently; not here
    monkeypatch.setattr(DraftBudget, "cap", lambda self, k: k)
    model = str(build_model(tmp_path / family, family))
    plain = _json_run(capsys, model, REPEATING, "-n", "24")
    spec = _json_run(capsys, model, REPEATING, "-n", "24", "--speculative", "prompt-lookup")
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    stats = spec["stats"]
    assert isinstance(stats, dict) and stats["proposed_draft_tokens"] > 0  # it really drafted
    assert "proposed_draft_tokens" not in plain["stats"]  # type: ignore[operator]
    argv = [
        "generate",
        model,
        REPEATING,
        "-n",
        "24",
        "--temp",
        "0",
        "--threads",
        "1",
        "--speculative",
        "prompt-lookup",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{plain['text']}\n"
    match = DRAFTS.search(captured.err)
    assert match is not None, captured.err
    accepted, proposed, forwards = int(match[1]), int(match[2]), int(match[3])
    assert (accepted, proposed, forwards) == (
        stats["accepted_draft_tokens"],
        stats["proposed_draft_tokens"],
        stats["target_forward_passes"],
    )
    assert float(match[4]) == pytest.approx(stats["generated_tokens"] / forwards, abs=0.005)
    if family == "genai-dense":
        assert accepted > 0  # this random model follows the repeated line: drafts were accepted
    else:
        assert accepted < proposed  # rejected drafts: the recurrent state was brought back, same tokens


def test_generate_with_a_draft_model_directory_keeps_the_tokens_and_drafts_from_it(
    dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    draft = build_model(tmp_path / "draft", "standard-dense")  # same spec and tokenizer, another graph
    plain = _json_run(capsys, str(dense_dir), PROMPT, "-n", "16")
    flags = ["--speculative", f"draft:{draft}", "--draft-tokens", "3"]
    spec = _json_run(capsys, str(dense_dir), PROMPT, "-n", "16", *flags)
    assert spec["token_ids"] == plain["token_ids"]
    stats = spec["stats"]
    assert isinstance(stats, dict)
    assert stats["accepted_draft_tokens"] > 0 and stats["target_forward_passes"] < 16


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (
            ["--speculative", "ngram"],
            ["--speculative 'ngram' is not a mode", "prompt-lookup", "draft:PATH", "mtp"],
        ),
        (["--speculative", "draft:"], ["names no draft model", "draft:PATH"]),
        (["--speculative", "mtp"], ["needs the model's MTP head", "onnxgen export-mtp"]),
        (["--speculative", "draft:/no/such/draft"], ["/no/such/draft does not exist"]),
        (["--draft-tokens", "3"], ["--draft-tokens 3 needs --speculative"]),
        (
            ["--speculative", "prompt-lookup", "--draft-tokens", "0"],
            ["--draft-tokens must be an integer >= 1"],
        ),
    ],
)
def test_generate_rejects_a_bad_speculative_setting_in_one_line_with_exit_2(
    dense_dir: Path, flags: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", str(dense_dir), PROMPT, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    _one_line_error(captured.err, *needles)


# -- numerics --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_a_model_with_nan_weights_is_an_error_naming_the_export_not_greedy_text(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = poison_weights(build_model(tmp_path / family, family))
    with pytest.raises(
        GenerationError, match=f"the export {re.escape(str(model / 'model.onnx'))} computed non-finite"
    ):
        load(model, threads=1).generate(PROMPT, SamplingParams(max_new_tokens=4))
    assert main(["generate", str(model), PROMPT, "-n", "4", "--temp", "0", "--threads", "1"]) == 2
    captured = capsys.readouterr()
    _one_line_error(captured.err, "non-finite logits", str(model / "model.onnx"))
    assert captured.out.strip() == ""
