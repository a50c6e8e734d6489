"""The tiny models and prompts of the engine's speculative tests (a module's own ``llm`` fixture overrides
this one)."""

from __future__ import annotations

import pytest

import onnxgen
from onnxgen import LLM, SamplingParams
from onnxgen.testing import build_model


@pytest.fixture(scope="module", params=["genai-dense", "hybrid-genai"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = build_model(tmp_path_factory.mktemp(request.param), request.param)
    return onnxgen.load(model, threads=1, max_batch=4, prefill_chunk=4, min_rows=1)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """Prompts that repeat a head and the model's own continuation of it, so that prompt lookup finds
    drafts the model accepts."""
    greedy = SamplingParams(max_new_tokens=14, ignore_eos=True)
    out = []
    for k, n in enumerate((6, 9, 4, 11)):
        head = [(37 * i + 11 * k) % 300 + 3 for i in range(n)]
        head += head[:5] + head
        reply = llm.generate(head, greedy).token_ids
        out.append(head + reply[:6] + head + reply[:3])
    return out
