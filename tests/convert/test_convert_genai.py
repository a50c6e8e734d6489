"""A converted GGUF runs on onnxruntime-genai too: greedy tokens equal onnxgen's (skipped without it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_fixtures import Spec, write_gguf

from onnxgen import load
from onnxgen.convert import convert_gguf

pytestmark = pytest.mark.external


@pytest.mark.parametrize(
    "spec", [Spec(qtype=T.Q4_1), Spec(arch="qwen3", qtype=T.Q6_K)], ids=["llama-q4_1", "qwen3-q6_k"]
)
def test_onnxruntime_genai_decodes_the_same_greedy_tokens(tmp_path: Path, spec: Spec) -> None:
    og = pytest.importorskip("onnxruntime_genai")
    g = write_gguf(tmp_path / "m.gguf", spec)
    model_dir = convert_gguf(g.path, tmp_path / "model")
    prompt = [258, 40, 71, 72, 80]  # no pad id (259): onnxruntime-genai masks pad tokens out
    ours = load(model_dir).generate(prompt, max_new_tokens=8, ignore_eos=True).token_ids
    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 8, do_sample=False, min_length=len(prompt) + 8)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, dtype=np.int32))
    theirs = []
    while not gen.is_done():
        gen.generate_next_token()
        theirs.append(int(gen.get_next_tokens()[0]))
    assert theirs == ours
