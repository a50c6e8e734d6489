"""End-of-sequence ids of packages without genai_config: from the tokenizer's end-of-text tokens, said by
`inspect`; a package that has none loads with one warning and stops where the request's stop ids say."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import onnxgen
from onnxgen.cli import main as cli_main
from onnxgen.model import ModelPackage
from onnxgen.testing import SPECIAL_TOKENS, build_model, special_token_ids

PACKAGE = Path(__file__).parent.parent / "fixtures" / "onnx-genai-model-package-cpu"


def _mobius_like(tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    """A mobius-style package (inference_metadata.yaml, tokenizer.json only) whose tokenizer lacks ``drop``."""
    out = build_model(tmp_path / "m", "hybrid-mobius", config="metadata")
    (out / "tokenizer_config.json").unlink()
    data = json.loads((out / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in drop]
    data["model"]["vocab"] = {k: v for k, v in data["model"]["vocab"].items() if k not in drop}
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out


def test_a_package_with_only_tokenizer_json_stops_at_its_end_of_text_tokens(tmp_path: Path) -> None:
    package = ModelPackage.open(_mobius_like(tmp_path))
    ids = special_token_ids(320)
    assert SPECIAL_TOKENS[0] == "<|endoftext|>" and "<|im_end|>" in ids
    assert package.eos_token_ids == tuple(sorted({ids["<|endoftext|>"], ids["<|im_end|>"]}))
    assert (
        package.settings.source_of("eos_token_id")
        == "tokenizer.json special tokens <|endoftext|>, <|im_end|>"
    )


def test_the_onnx_genai_package_takes_eos_from_its_tokenizers_eos_token_and_inspect_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert ModelPackage.open(PACKAGE).eos_token_ids == (3,)  # "<eos>" in its WordLevel vocabulary
    assert cli_main(["inspect", str(PACKAGE)]) == 0
    assert "eos from:       tokenizer.json special tokens <eos>" in capsys.readouterr().out


def test_a_config_that_states_eos_outranks_the_tokenizers_tokens(tmp_path: Path) -> None:
    out = _mobius_like(tmp_path)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    package = ModelPackage.open(out)
    assert (
        package.eos_token_ids == (7,)
        and package.settings.source_of("eos_token_id") == "generation_config.json"
    )


def test_no_eos_anywhere_warns_once_at_load_inspect_says_so_and_stop_token_ids_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _mobius_like(tmp_path, drop=("<|endoftext|>", "<|im_end|>"))
    with caplog.at_level(logging.WARNING, logger="onnxgen"):
        llm = onnxgen.load(out, threads=1)
    warned = [r for r in caplog.records if "names no end-of-sequence token" in r.getMessage()]
    assert len(warned) == 1 and "stop_token_ids" in warned[0].getMessage()
    assert llm.eos_token_ids == ()
    free = llm.generate([5, 6, 7], onnxgen.SamplingParams(max_new_tokens=12))
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[4]
    stopped = llm.generate([5, 6, 7], onnxgen.SamplingParams(max_new_tokens=12, stop_token_ids=[stop_at]))
    first = free.token_ids.index(stop_at)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    assert cli_main(["inspect", str(out)]) == 0
    assert "eos from:       nowhere" in capsys.readouterr().out


def test_stop_token_ids_must_be_a_list_of_ids() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        onnxgen.SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="stop_token_ids"):
        onnxgen.SamplingParams(stop_token_ids="2")  # type: ignore[arg-type]
    assert onnxgen.SamplingParams(stop_token_ids=[2, 5]).stop_token_ids == (2, 5)
