"""onnxruntime-genai itself loads and runs the genai-family fixtures (external tier: skipped without it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxgen.testing import TinySpec, build_model, make_weights
from onnxgen.testing.reference import reference_logits

og = pytest.importorskip("onnxruntime_genai")
pytestmark = pytest.mark.external


@pytest.mark.parametrize(
    ("family", "spec"), [("genai-dense", TinySpec()), ("hybrid-genai", TinySpec.hybrid())]
)
def test_onnxruntime_genai_greedy_decoding_follows_the_reference(
    tmp_path: Path, family: str, spec: TinySpec
) -> None:
    model = og.Model(str(build_model(tmp_path, family, spec)))
    prompt = [int(t) for t in og.Tokenizer(model).encode("Hello, world!")]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 6, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    first_logits = np.asarray(gen.get_output("logits"))[0, -1]
    tokens: list[int] = []
    while not gen.is_done():
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    weights = make_weights(spec)
    ref = reference_logits(spec, weights, prompt + tokens)
    np.testing.assert_allclose(first_logits, ref[len(prompt) - 1], atol=1e-4, rtol=0)
    expected = ref[len(prompt) - 1 : -1].argmax(axis=-1)
    assert tokens == expected.tolist()
