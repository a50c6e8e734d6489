"""MTP heads against independent implementations: transformers' Qwen3.5 decoder layer for the NumPy
reference, onnxruntime-genai's own ``mtp.onnx`` for ``onnxgen export-mtp``; and a head onnxruntime-genai
exported beside its decoder, picked up and run as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

import onnxgen
from onnxgen import MTP, SamplingParams
from onnxgen.export.mtp import export_mtp
from onnxgen.export.mtp_weights import geometry_from_config, read_mtp_checkpoint
from onnxgen.model.mtp import find_mtp_head, mtp_head_io
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.mtp_head import MTPHeadSession
from onnxgen.testing.hf import build_qwen3_5_checkpoint, export_with_genai_builder
from onnxgen.testing.mtp import mtp_reference

if TYPE_CHECKING:
    from conftest import TinyExports

pytestmark = pytest.mark.external

PROMPT = [5, 17, 200, 33, 44, 91, 12, 8]


@pytest.fixture(scope="module")
def checkpoint(tiny_exports: TinyExports) -> Path:
    ck = tiny_exports.root / "hf" / "qwen3_5_mtp"
    if not (ck / "config.json").is_file():
        build_qwen3_5_checkpoint(ck, "tiny", seed=0, mtp=True)
    return ck


@pytest.fixture(scope="module")
def genai_export(tiny_exports: TinyExports, checkpoint: Path) -> Path:
    """onnxruntime-genai's builder on a checkpoint with a head: decoder (with hidden_states) and mtp.onnx."""
    out = tiny_exports.root / "qwen3_5_mtp-fp32"
    if not (out / "genai_config.json").is_file():
        export_with_genai_builder(checkpoint, out, "fp32", cache_dir=tiny_exports.root / ".builder-cache")
    assert (out / "mtp.onnx").is_file(), "the builder did not export the head"
    return out


def test_the_numpy_reference_is_the_transformers_qwen3_5_layer_between_the_mtp_norms_and_fc(
    checkpoint: Path,
) -> None:
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5RMSNorm,
        Qwen3_5TextRotaryEmbedding,
    )

    config = AutoConfig.from_pretrained(checkpoint).text_config
    config._attn_implementation = "eager"
    g, w = read_mtp_checkpoint(checkpoint)
    from safetensors.numpy import load_file

    tensors = load_file(str(checkpoint / "model.safetensors"))
    embed = tensors["model.language_model.embed_tokens.weight"]
    lm_head = tensors["lm_head.weight"].T
    rng = np.random.default_rng(0)
    t = 7
    tokens = rng.integers(0, g.vocab, t)
    hidden = rng.standard_normal((t, g.hidden)).astype(np.float32)

    def norm(name: str) -> Qwen3_5RMSNorm:
        n = Qwen3_5RMSNorm(g.hidden, eps=g.rms_eps)
        n.weight.data = torch.from_numpy(w[name])
        return n

    layer_index = config.layer_types.index("full_attention")
    layer = Qwen3_5DecoderLayer(config, layer_idx=layer_index).eval()
    layer.load_state_dict(
        {
            k.removeprefix("mtp.layers.0."): torch.from_numpy(v)
            for k, v in w.items()
            if k.startswith("mtp.layers.0.")
        }
    )
    with torch.no_grad():
        e = norm("mtp.pre_fc_norm_embedding.weight")(torch.from_numpy(embed[tokens])[None])
        h = norm("mtp.pre_fc_norm_hidden.weight")(torch.from_numpy(hidden)[None])
        x = torch.cat([e, h], dim=-1) @ torch.from_numpy(w["mtp.fc.weight"]).T
        positions = torch.arange(t)[None]
        cos_sin = Qwen3_5TextRotaryEmbedding(config)(x, positions)
        causal = torch.full((1, 1, t, t), float("-inf")).triu(1)
        y = norm("mtp.norm.weight")(
            layer(x, position_embeddings=cos_sin, attention_mask=causal, position_ids=positions)
        )
        logits = (y @ torch.from_numpy(lm_head)).numpy()[0]
    ref_logits, ref_hidden, _, _ = mtp_reference(g, w, embed, lm_head, tokens, hidden)
    np.testing.assert_allclose(y.numpy()[0], ref_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_an_onnxruntime_genai_head_is_picked_up_as_it_is_and_keeps_the_plain_greedy_tokens(
    genai_export: Path,
) -> None:
    llm = onnxgen.load(genai_export, threads=1)
    assert llm.session.hidden_state == "hidden_states"  # the builder's own output, not one the pass added
    head = llm.mtp_head().head
    assert head.path == genai_export / "mtp.onnx" and head.io.position_ids_rank == 3
    params = SamplingParams(max_new_tokens=24)
    plain = llm.generate(PROMPT, params)
    result = llm.generate(PROMPT, params, speculative=MTP(num_draft_tokens=2, auto=False))
    assert result.token_ids == plain.token_ids
    assert result.stats["proposed_draft_tokens"] > 0


def heads(*dirs: Path) -> list[MTPHeadSession]:
    out = []
    for d in dirs:
        package = ModelPackage.open(d)
        path = find_mtp_head(package)
        assert path is not None
        out.append(MTPHeadSession(mtp_head_io(package, path), threads=1))
    return out


def test_export_mtp_writes_the_head_onnxruntime_genai_builds_from_the_same_checkpoint(
    genai_export: Path, checkpoint: Path, tmp_path: Path
) -> None:
    ours = tmp_path / "ours"
    ours.mkdir()
    for name in ("model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(genai_export / name, ours / name)
    config = json.loads((genai_export / "genai_config.json").read_text())
    del config["model"]["mtp"]
    (ours / "genai_config.json").write_text(json.dumps(config))
    report = export_mtp(checkpoint, ours)
    assert sorted(report.shared) == ["lm_head.MatMul.weight", "model.embed_tokens.weight"]
    theirs, mine = heads(genai_export, ours)
    g = geometry_from_config(json.loads((checkpoint / "config.json").read_text()))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, g.vocab, (1, 6))
    hidden = rng.standard_normal((1, 6, g.hidden)).astype(np.float32)
    results = []
    for head in (theirs, mine):
        state = head.new_state(16)
        first = head.forward(state, tokens[:, :4], hidden[:, :4])
        second = head.forward(state, tokens[:, 4:], hidden[:, 4:])
        results.append((*first, *second, *state.kv_arrays().values()))
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
