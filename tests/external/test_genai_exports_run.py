"""onnxruntime-genai and plain onnxruntime run the tiny model-builder exports, and agree with each other
and with HF transformers (the facts docs/export-families.md records)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from onnxgen.testing.hf import SIZES

if TYPE_CHECKING:
    from conftest import TinyExport

pytestmark = pytest.mark.external

PROMPT = [5, 6, 7, 8, 9, 10]
NEW_TOKENS = 8


def _genai_greedy(export: TinyExport, prompt: list[int], new_tokens: int) -> list[int]:
    import onnxruntime_genai as og

    model = og.Model(str(export.onnx_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)]


def _genai_config(export: TinyExport) -> dict[str, Any]:
    return json.loads((export.onnx_dir / "genai_config.json").read_text())


class _PlainLoop:
    """A minimal onnxruntime decode loop: empty past at prefill, present fed back as past (growing)."""

    def __init__(self, export: TinyExport) -> None:
        import onnxruntime as ort

        self.sess = ort.InferenceSession(str(export.model_path), providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.outputs = [o.name for o in self.sess.get_outputs()]
        dec = _genai_config(export)["model"]["decoder"]
        self.kv_shape = (1, dec["num_key_value_heads"], 0, dec["head_size"])

    def _empty_past(self) -> dict[str, np.ndarray]:
        past: dict[str, np.ndarray] = {}
        for name, port in self.inputs.items():
            if name.startswith("past_key_values."):
                past[name] = np.zeros(self.kv_shape, np.float32)
            elif name.startswith("past."):  # fixed-shape recurrent / conv state
                past[name] = np.zeros((1, *port.shape[1:]), np.float32)
        return past

    def _run(self, ids: list[int], start: int, past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        n = len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, start + n), np.int64)}
        if "position_ids" in self.inputs:  # mRoPE: three identical text rows [3, batch, seq]
            feeds["position_ids"] = np.tile(np.arange(start, start + n, dtype=np.int64), (3, 1, 1))
        results = self.sess.run(None, {**feeds, **past})
        new_past = {}
        for name, value in zip(self.outputs[1:], results[1:], strict=True):
            kind = name.rsplit(".", 1)[-1]
            prefix = "past_key_values." if kind in ("key", "value") else "past."
            new_past[prefix + name.removeprefix("present.")] = value
        return results[0], new_past

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
        """Greedy tokens and the prefill's last-position logits."""
        logits, past = self._run(prompt, 0, self._empty_past())
        first_logits = logits[0, -1]
        seq = list(prompt)
        for _ in range(new_tokens):
            seq.append(int(logits[0, -1].argmax()))
            if len(seq) == len(prompt) + new_tokens:
                break
            logits, past = self._run(seq[-1:], len(seq) - 1, past)
        return seq, first_logits


def test_onnxruntime_genai_generates_greedily_from_each_tiny_export(tiny_export: TinyExport) -> None:
    seq = _genai_greedy(tiny_export, PROMPT, NEW_TOKENS)
    vocab = _genai_config(tiny_export)["model"]["vocab_size"]
    assert seq[: len(PROMPT)] == PROMPT
    new = seq[len(PROMPT) :]
    assert 1 <= len(new) <= NEW_TOKENS
    assert all(0 <= t < vocab for t in new)
    assert _genai_greedy(tiny_export, PROMPT, NEW_TOKENS) == seq, "greedy decoding is not deterministic"


def test_plain_onnxruntime_opens_each_export_with_the_genai_config_port_names(
    tiny_export: TinyExport,
) -> None:
    import onnxruntime as ort

    size = SIZES["tiny"]
    sess = ort.InferenceSession(str(tiny_export.model_path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in sess.get_inputs()}
    outputs = {o.name: o.shape for o in sess.get_outputs()}
    dec = _genai_config(tiny_export)["model"]["decoder"]
    names = {**dec["inputs"], **dec["outputs"]}
    assert inputs["input_ids"] == ["batch_size", "sequence_length"]
    assert inputs["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert outputs["logits"] == ["batch_size", "sequence_length", size.vocab]
    attn = [3] if tiny_export.is_hybrid else list(range(size.layers))
    kv_in = [names[t] % i for i in attn for t in ("past_key_names", "past_value_names")]
    assert sorted(n for n in inputs if n.startswith("past_key_values.")) == sorted(kv_in)
    for i in attn:
        past, present = inputs[names["past_key_names"] % i], outputs[names["present_key_names"] % i]
        assert past == ["batch_size", size.kv_heads, "past_sequence_length", "kv_cache_dim"]
        assert present == ["batch_size", size.kv_heads, "total_sequence_length", "kv_cache_dim"]
    if tiny_export.is_hybrid:
        conv = [
            "batch_size",
            2 * size.lin_key_heads * size.lin_key_dim + size.lin_value_heads * size.lin_value_dim,
            3,
        ]
        rec = ["batch_size", size.lin_value_heads, size.lin_key_dim, size.lin_value_dim]
        assert inputs["position_ids"] == [3, "batch_size", "sequence_length"]
        for i in (0, 1, 2):
            assert inputs[names["past_conv_names"] % i] == outputs[names["present_conv_names"] % i] == conv
            assert (
                inputs[names["past_recurrent_names"] % i]
                == outputs[names["present_recurrent_names"] % i]
                == rec
            )
    else:
        assert "position_ids" not in inputs
        assert not any(n.startswith("past.") for n in inputs)


def test_plain_onnxruntime_greedy_loop_matches_onnxruntime_genai(tiny_export: TinyExport) -> None:
    seq, _ = _PlainLoop(tiny_export).greedy(PROMPT, NEW_TOKENS)
    genai = _genai_greedy(tiny_export, PROMPT, NEW_TOKENS)
    assert seq[: len(genai)] == genai


def _hf_model(export: TinyExport) -> Any:
    import torch
    import transformers

    cls = (
        transformers.Qwen3_5ForConditionalGeneration
        if export.is_hybrid
        else transformers.AutoModelForCausalLM
    )
    return cls.from_pretrained(export.hf_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["qwen3_fp32", "llama_fp32", "qwen3_5_fp32"])
def test_fp32_export_prefill_logits_match_transformers(name: str, request: pytest.FixtureRequest) -> None:
    export: TinyExport = request.getfixturevalue(name)  # (skips without the external packages)
    import torch

    _, ort_logits = _PlainLoop(export).greedy(PROMPT, 1)
    with torch.no_grad():
        hf_logits = _hf_model(export)(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0, -1].numpy()
    # Measured: ~2e-6 for the dense families, ~3e-5 for the hybrid (chunked vs recurrent delta rule).
    assert np.abs(ort_logits - hf_logits).max() < 2e-4


@pytest.mark.parametrize("name", ["qwen3_fp32", "llama_fp32", "qwen3_5_fp32"])
def test_fp32_export_greedy_tokens_match_transformers_generate(
    name: str, request: pytest.FixtureRequest
) -> None:
    export: TinyExport = request.getfixturevalue(name)  # (skips without the external packages)
    import torch

    with torch.no_grad():
        hf = (
            _hf_model(export)
            .generate(
                torch.tensor([PROMPT]),
                attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )[0]
            .tolist()
        )
    genai = _genai_greedy(export, PROMPT, NEW_TOKENS)  # stops early only at eos
    assert genai == hf[: len(genai)]
