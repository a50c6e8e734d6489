"""The files beside ``model.onnx``: configs in each exporter's format and the tokenizer.

``config`` values:

- ``"genai"``: ``genai_config.json`` (onnxruntime-genai format; name templates for every port family that
  follows the builder's naming, so a mobius-named model gets KV templates only, as mobius writes it),
  ``config.json`` (HF-like) and ``generation_config.json``.
- ``"metadata"``: ``inference_metadata.yaml`` with a mobius ``model.io`` block.
- ``"none"``: no config at all (tokenizer files only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from onnxgen.testing.families import Ports, Style
from onnxgen.testing.spec import TinySpec
from onnxgen.testing.tokenizer import EOS_TOKEN, IM_END, special_token_ids, write_tokenizer

CONFIGS = ("genai", "metadata", "none")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=4) + "\n")


def _eos_ids(spec: TinySpec) -> list[int]:
    ids = special_token_ids(spec.vocab_size)
    return [ids[EOS_TOKEN], ids[IM_END]]


def _io_templates(ports: Ports) -> tuple[dict[str, str], dict[str, str]]:
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    outputs = {"logits": "logits"}
    if ports.position_ids is not None:
        inputs["position_ids"] = ports.position_ids
    if ports.variant.kv == "static":  # the static form has no attention mask
        del inputs["attention_mask"]
    if ports.kv and ports.variant.kv == "stacked":
        inputs["past_names"], outputs["present_names"] = "past_%d", "present_%d"
    elif ports.kv and ports.variant.kv == "split":  # (genai_config cannot state static caches)
        inputs |= {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
        outputs |= {"present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    if any(st.input == f"past.{st.layer}.conv" for st in ports.states):
        inputs |= {"past_conv_names": "past.%d.conv", "past_recurrent_names": "past.%d.recurrent"}
        outputs |= {
            "present_conv_names": "present.%d.conv",
            "present_recurrent_names": "present.%d.recurrent",
        }
    return inputs, outputs


def genai_config(spec: TinySpec, style: Style, ports: Ports) -> dict[str, Any]:
    """``genai_config.json`` as onnxruntime-genai's model builder writes it."""
    inputs, outputs = _io_templates(ports)
    eos = _eos_ids(spec)
    return {
        "model": {
            "bos_token_id": 1,  # the builder's fallback when the model has no BOS (genai rejects null)
            "context_length": spec.max_position,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": spec.head_dim,
                "hidden_size": spec.hidden,
                "inputs": inputs,
                "outputs": outputs,
                "num_attention_heads": spec.num_heads,
                "num_hidden_layers": spec.num_layers,
                "num_key_value_heads": spec.num_kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": eos[0],
            "type": "qwen3_5_text" if style.hybrid else "llama",
            "vocab_size": spec.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": spec.max_position,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": style.attention == "gqa" and ports.variant.kv == "split",
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def hf_config(spec: TinySpec, style: Style) -> dict[str, Any]:
    """An HF-like ``config.json`` describing the same geometry."""
    eos = _eos_ids(spec)
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3_5ForCausalLM" if style.hybrid else "LlamaForCausalLM"],
        "model_type": "qwen3_5_text" if style.hybrid else "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos[0],
        "pad_token_id": eos[0],
        "torch_dtype": "float32",
    }
    if style.hybrid:
        cfg |= {
            "layer_types": ["full_attention" if t == "attention" else "linear_attention" for t in spec.types],
            "linear_num_key_heads": spec.lin_key_heads,
            "linear_num_value_heads": spec.lin_value_heads,
            "linear_key_head_dim": spec.lin_key_dim,
            "linear_value_head_dim": spec.lin_value_dim,
            "linear_conv_kernel_dim": spec.conv_kernel,
        }
    return cfg


def generation_config(spec: TinySpec) -> dict[str, Any]:
    eos = _eos_ids(spec)
    return {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos[0], "do_sample": False}


def inference_metadata(ports: Ports) -> dict[str, Any]:
    """mobius ``inference_metadata.yaml``: the ``model.io`` block (KV lists paired by position)."""
    io: dict[str, Any] = {
        "token_input": "input_ids",
        "attention_mask_input": "attention_mask",
        "position_ids_input": ports.position_ids,
        "logits_output": "logits",
        "kv_inputs": [n for p in ports.kv for n in (p.past_key, p.past_value)],
        "kv_outputs": [n for p in ports.kv for n in (p.present_key, p.present_value)],
        "state_pairs": [
            {"input": st.input, "output": st.output, "init": "zeros", "update": "replace"}
            for st in ports.states
        ],
    }
    if ports.position_ids is None:
        del io["position_ids_input"]
    if ports.variant.kv == "static":
        del io["attention_mask_input"], io["kv_inputs"], io["kv_outputs"]
        io["static_cache"] = {
            "write_indices_input": "write_indices",
            "kv_sequence_length_input": "nonpad_kv_seqlen",
            "key_cache_inputs": [p.past_key for p in ports.kv],
            "value_cache_inputs": [p.past_value for p in ports.kv],
            "key_cache_outputs": [p.present_key for p in ports.kv],
            "value_cache_outputs": [p.present_value for p in ports.kv],
        }
    elif ports.variant.kv == "stacked":  # model.io has no stacked form: the graph rules pair past_N/present_N
        del io["kv_inputs"], io["kv_outputs"]
    return {"model": {"io": io}}


def write_package(out: Path, spec: TinySpec, style: Style, ports: Ports, config: str) -> None:
    """Write the config files ``config`` asks for and the tokenizer files into ``out``."""
    if config == "genai":
        _write_json(out / "genai_config.json", genai_config(spec, style, ports))
        _write_json(out / "config.json", hf_config(spec, style))
        _write_json(out / "generation_config.json", generation_config(spec))
    elif config == "metadata":
        text = yaml.safe_dump(inference_metadata(ports), sort_keys=False, default_flow_style=False)
        (out / "inference_metadata.yaml").write_text(text)
    write_tokenizer(out, spec.vocab_size, spec.max_position)
