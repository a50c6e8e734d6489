"""``onnxgen export-mtp CHECKPOINT_DIR EXPORT_DIR`` from a checkpoint written in code (config.json and
safetensors in Qwen3.5's naming), then ``--speculative mtp`` on the result; short errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from onnxgen import MTP, SamplingParams, load
from onnxgen.cli import main
from onnxgen.export.mtp import MTP_FILE
from onnxgen.export.mtp_weights import geometry_from_config
from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.mtp import geometry_of, make_mtp_weights

SPEC = TinySpec.hybrid()


def qwen35_config(spec: TinySpec) -> dict[str, object]:
    """config.json as a Qwen3.5 checkpoint writes it (geometry under text_config)."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {
            "hidden_size": spec.hidden,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "intermediate_size": spec.intermediate,
            "vocab_size": spec.vocab_size,
            "rms_norm_eps": spec.rms_eps,
            "mtp_num_hidden_layers": 1,
            "rope_parameters": {"rope_theta": spec.rope_theta, "partial_rotary_factor": 0.25},
        },
    }


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    ck = tmp_path / "checkpoint"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(qwen35_config(SPEC)))
    weights = make_mtp_weights(geometry_of(SPEC), seed=5)
    other = {"model.language_model.norm.weight": np.zeros(SPEC.hidden, dtype=np.float32)}
    safetensors_numpy.save_file(
        {**weights, **other}, str(ck / "model.safetensors"), metadata={"format": "pt"}
    )
    return ck


def test_the_config_gives_the_geometry_the_tiny_decoder_has(checkpoint: Path) -> None:
    assert geometry_from_config(json.loads((checkpoint / "config.json").read_text())) == geometry_of(SPEC)


def test_export_mtp_writes_a_head_that_mtp_speculation_runs_with(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = build_model(tmp_path / "model", "hybrid-genai", SPEC)
    assert main(["export-mtp", str(checkpoint), str(d)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {d / MTP_FILE} (fp32)" in out and "shares embed, lm_head" in out
    assert main(["inspect", str(d)]) == 0
    assert "MTP head:       mtp.onnx (reads 'hidden_states'" in capsys.readouterr().out
    llm = load(d, threads=1)
    params = SamplingParams(max_new_tokens=12)
    plain = llm.generate([5, 17, 200, 33], params)
    result = llm.generate([5, 17, 200, 33], params, speculative=MTP(auto=False))
    assert result.token_ids == plain.token_ids
    assert result.stats["proposed_draft_tokens"] > 0


def test_export_mtp_of_a_checkpoint_without_a_head_says_so(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file(
        {"lm_head.weight": np.zeros((4, 4), np.float32)}, str(checkpoint / "model.safetensors")
    )
    d = build_model(tmp_path / "model", "hybrid-genai", SPEC)
    assert main(["export-mtp", str(checkpoint), str(d)]) == 2
    err = capsys.readouterr().err
    assert "no mtp.* tensors" in err and "Traceback" not in err


def test_export_mtp_into_a_directory_without_an_export_says_so(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export-mtp", str(checkpoint), str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_export_mtp_leaves_a_head_onnxruntime_genai_exported_alone(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = build_model(tmp_path / "model", "hybrid-genai", SPEC)
    config = json.loads((d / "genai_config.json").read_text())
    config["model"]["mtp"] = {"enabled": True, "filename": MTP_FILE}
    (d / "genai_config.json").write_text(json.dumps(config))
    assert main(["export-mtp", str(checkpoint), str(d)]) == 2
    assert "already has an MTP head" in capsys.readouterr().err
    assert not (d / MTP_FILE).exists()
