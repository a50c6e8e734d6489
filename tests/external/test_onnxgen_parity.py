"""onnxgen on real onnxruntime-genai builder exports: same greedy tokens as onnxruntime-genai and as HF
transformers (EOS ignored on every side), the right topology from `onnxgen inspect`, and speculative
decoding that reproduces plain greedy on the hybrid export."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import pytest

import onnxgen
from onnxgen.cli import main as cli_main

if TYPE_CHECKING:
    from conftest import TinyExport

pytestmark = pytest.mark.external

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
NEW_TOKENS = 24
GREEDY = onnxgen.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def _genai_greedy_ignoring_eos(export: TinyExport) -> list[int]:
    import onnxruntime_genai as og

    model = og.Model(str(export.onnx_dir))
    params = og.GeneratorParams(model)
    total = len(PROMPT) + NEW_TOKENS
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(PROMPT, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(PROMPT) :]


def _hf_greedy(export: TinyExport) -> list[int]:
    import torch
    import transformers

    cls = (
        transformers.Qwen3_5ForConditionalGeneration
        if export.is_hybrid
        else transformers.AutoModelForCausalLM
    )
    model = cls.from_pretrained(export.hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("name", ["qwen3_fp32", "llama_fp32", "qwen3_5_fp32"])
def test_onnxgen_greedy_equals_onnxruntime_genai_and_transformers(
    name: str, request: pytest.FixtureRequest
) -> None:
    export: TinyExport = request.getfixturevalue(name)
    ours = onnxgen.load(export.onnx_dir, threads=1).generate(PROMPT, GREEDY).token_ids
    assert len(ours) == NEW_TOKENS
    assert ours == _genai_greedy_ignoring_eos(export)
    assert ours == _hf_greedy(export)


@pytest.mark.parametrize("name", ["qwen3_int4", "qwen3_5_int4"])
def test_onnxgen_greedy_equals_onnxruntime_genai_on_int4_exports(
    name: str, request: pytest.FixtureRequest
) -> None:
    export: TinyExport = request.getfixturevalue(name)
    ours = onnxgen.load(export.onnx_dir, threads=1).generate(PROMPT, GREEDY).token_ids
    assert ours == _genai_greedy_ignoring_eos(export)


def test_inspect_reports_the_builder_topology_of_each_export(
    tiny_export: TinyExport, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["inspect", str(tiny_export.onnx_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "genai_config"
    assert info["token_input"] == "input_ids" and info["attention_mask"] == "attention_mask"
    assert info["logits"] == "logits"
    genai = json.loads((tiny_export.onnx_dir / "genai_config.json").read_text())["model"]["decoder"]
    if tiny_export.is_hybrid:
        assert info["position_ids"] == "position_ids"
        assert len(info["kv_pairs"]) == 1  # one full-attention layer in four (layer 3)
        assert len(info["state_pairs"]) == 2 * 3  # conv + recurrent for layers 0, 1, 2
    else:
        assert info["position_ids"] is None
        assert len(info["kv_pairs"]) == genai["num_hidden_layers"]
        assert info["state_pairs"] == []


def test_prompt_lookup_on_the_hybrid_export_reproduces_plain_greedy(qwen3_5_fp32: TinyExport) -> None:
    llm = onnxgen.load(qwen3_5_fp32.onnx_dir, threads=1)
    first = llm.generate(PROMPT, GREEDY).token_ids
    prompt = PROMPT + first + PROMPT  # the continuation tends to repeat an earlier span
    plain = llm.generate(prompt, GREEDY)
    spec = llm.generate(prompt, GREEDY, speculative=onnxgen.PromptLookup(num_draft_tokens=4))
    assert spec.token_ids == plain.token_ids
    assert spec.stats["accepted_draft_tokens"] > 0
    assert spec.stats["target_forward_passes"] < plain.stats["forward_passes"]
