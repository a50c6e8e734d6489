"""Token ids and context length: which file wins, and disagreements recorded as notes."""

from __future__ import annotations

from pathlib import Path

from sigbuild import base_inputs, logits_port, sig_model, write_package

from onnxgen.model import ModelPackage


def _open(tmp_path: Path, files: dict[str, object]) -> ModelPackage:
    model = sig_model(base_inputs(), [logits_port()])
    return ModelPackage.open(write_package(tmp_path, model, files))


def test_generation_config_beats_genai_config_beats_config_json_for_eos(tmp_path: Path) -> None:
    pkg = _open(
        tmp_path,
        {
            "generation_config.json": {"eos_token_id": [151645, 151643], "bos_token_id": 1},
            "genai_config.json": {"model": {"eos_token_id": 7, "pad_token_id": 3}},
            "config.json": {"eos_token_id": 8, "bos_token_id": 2, "pad_token_id": 4},
        },
    )
    assert pkg.eos_token_ids == (151645, 151643)
    assert pkg.bos_token_id == 1
    assert pkg.pad_token_id == 3  # generation_config states no pad: genai_config is next
    notes = "\n".join(pkg.notes)
    assert "eos_token_id: generation_config.json says [151645, 151643], genai_config.json says 7" in notes
    assert "config.json says 8" in notes
    assert "pad_token_id: genai_config.json says 3, config.json says 4" in notes


def test_equal_values_in_several_files_make_no_note(tmp_path: Path) -> None:
    pkg = _open(
        tmp_path, {"generation_config.json": {"eos_token_id": [2]}, "config.json": {"eos_token_id": 2}}
    )
    assert pkg.eos_token_ids == (2,)
    assert pkg.notes == ()


def test_context_length_prefers_genai_then_config_then_tokenizer(tmp_path: Path) -> None:
    files: dict[str, object] = {
        "genai_config.json": {"model": {"context_length": 4096}},
        "config.json": {"max_position_embeddings": 32768},
        "tokenizer_config.json": {"model_max_length": 131072},
    }
    assert _open(tmp_path / "a", files).context_length == 4096
    del files["genai_config.json"]
    assert _open(tmp_path / "b", files).context_length == 32768
    del files["config.json"]
    assert _open(tmp_path / "c", files).context_length == 131072


def test_context_length_disagreement_is_noted(tmp_path: Path) -> None:
    pkg = _open(
        tmp_path,
        {
            "genai_config.json": {"model": {"context_length": 4096}},
            "config.json": {"max_position_embeddings": 32768},
        },
    )
    assert any("context_length" in n and "4096" in n and "32768" in n for n in pkg.notes)


def test_tokenizer_no_limit_sentinel_is_not_a_context_length(tmp_path: Path) -> None:
    pkg = _open(tmp_path, {"tokenizer_config.json": {"model_max_length": 1000000000000000019884624838656}})
    assert pkg.context_length is None


def test_inference_metadata_tokens_and_length_outrank_every_other_file(tmp_path: Path) -> None:
    pkg = _open(
        tmp_path,
        {
            "inference_metadata.yaml": {
                "tokens": {"eos_token_id": [5]},
                "model": {"max_sequence_length": 512},
            },
            "generation_config.json": {"eos_token_id": 6},
            "genai_config.json": {"model": {"context_length": 4096}},
        },
    )
    assert pkg.eos_token_ids == (5,)
    assert pkg.context_length == 512


def test_multimodal_config_json_reads_text_config(tmp_path: Path) -> None:
    pkg = _open(
        tmp_path,
        {"config.json": {"text_config": {"eos_token_id": 248044, "max_position_embeddings": 262144}}},
    )
    assert pkg.eos_token_ids == (248044,)
    assert pkg.context_length == 262144


def test_tokenizer_config_token_strings_resolve_through_added_tokens(tmp_path: Path) -> None:
    tok_cfg = {
        "eos_token": "<|im_end|>",
        "pad_token": {"content": "<|endoftext|>"},
        "bos_token": "<s>",
        "added_tokens_decoder": {"151645": {"content": "<|im_end|>"}},
    }
    tokenizer = (
        '{"added_tokens": [{"id": 151643, "content": "<|endoftext|>"}], "model": {"vocab": {"<s>": 1}}}'
    )
    pkg = _open(tmp_path, {"tokenizer_config.json": tok_cfg, "tokenizer.json": tokenizer})
    assert pkg.eos_token_ids == (151645,)
    assert pkg.pad_token_id == 151643
    assert pkg.bos_token_id == 1


def test_tokenizer_config_is_the_last_resort_for_token_ids(tmp_path: Path) -> None:
    tok_cfg = {"eos_token": "<|im_end|>", "added_tokens_decoder": {"151645": {"content": "<|im_end|>"}}}
    pkg = _open(tmp_path, {"tokenizer_config.json": tok_cfg, "config.json": {"eos_token_id": 151643}})
    assert pkg.eos_token_ids == (151643,)
    assert any("tokenizer_config.json says 151645" in n for n in pkg.notes)
