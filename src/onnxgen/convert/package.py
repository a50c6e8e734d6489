"""A GGUF file written as an onnxgen model directory.

``model.onnx`` with its weights in ``model.onnx.data``, ``tokenizer.json``, ``tokenizer_config.json``
(chat template, special tokens) and ``genai_config.json`` in onnxruntime-genai's format, so that both
onnxgen and onnxruntime-genai load the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

from onnxgen.convert.blocks import check_types
from onnxgen.convert.decoder import build_model
from onnxgen.convert.graph import WeightFile
from onnxgen.convert.reader import GGUFFile, Hparams
from onnxgen.convert.tokenizer import build_tokenizer, special_ids, tokenizer_config
from onnxgen.errors import GGUFConversionError

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# MatMulNBits computes with float32 activations: the converted model computes what the GGUF's numbers say
# (4, int8 activations as llama.cpp computes these types, decodes about twice as fast; docs/gguf.md)
DEFAULT_ACCURACY_LEVEL = 1


def genai_config(hp: Hparams, ids: dict[str, Any]) -> dict[str, Any]:
    """``genai_config.json`` as onnxruntime-genai's builder writes it for this decoder."""
    return {
        "model": {
            "bos_token_id": ids["bos"],
            "context_length": hp.context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": hp.head_dim,
                "hidden_size": hp.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": hp.heads,
                "num_hidden_layers": hp.layers,
                "num_key_value_heads": hp.kv_heads,
            },
            "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"],
            "type": hp.arch,
            "vocab_size": hp.vocab,
        },
        "search": {
            "do_sample": False,
            "max_length": hp.context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def write_model_dir(
    src: str | Path, out_dir: str | Path, accuracy_level: int | None = None, float_weights: str = "keep"
) -> Path:
    """Convert ``src`` into ``out_dir`` (created; files there of the same names are replaced)."""
    level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    if level not in (0, 1, 2, 3, 4):
        raise GGUFConversionError(f"accuracy_level must be 0, 1, 2, 3 or 4 (MatMulNBits), got {level!r}")
    if float_weights not in ("keep", "int4"):
        raise GGUFConversionError(f"float_weights must be 'keep' or 'int4', got {float_weights!r}")
    f = GGUFFile(src)
    f.quantize_float = float_weights == "int4"
    hp = Hparams.read(f)
    check_types({name: t.tensor_type for name, t in f.tensors.items()})
    tok = build_tokenizer(f)  # before the weights: an unsupported tokenizer fails fast
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / DATA_FILE).open("wb") as fh:
        model = build_model(f, hp, level, WeightFile(fh, DATA_FILE))
    onnx.save_model(model, out / MODEL_FILE)
    tok.save(str(out / "tokenizer.json"))
    config = tokenizer_config(f, hp.context)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "genai_config.json").write_text(json.dumps(genai_config(hp, special_ids(f)), indent=4) + "\n")
    return out
