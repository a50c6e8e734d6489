"""The engine's scheduler resumes prompts from the prefix cache and caches finished rows, giving the tokens
plain decoding gives (``LLM.generate(list)``, the path the server's worker drives)."""

from __future__ import annotations

import numpy as np
import pytest

import onnxgen
from onnxgen import LLM, SamplingParams
from onnxgen.testing import build_model

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


SYSTEM = tokens(1, 21)


@pytest.fixture(scope="module", params=["genai-dense", "hybrid-genai"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, LLM]:
    model = build_model(tmp_path_factory.mktemp(request.param), request.param)
    plain = onnxgen.load(model, threads=1)
    cached = onnxgen.load(
        model, threads=1, max_batch=2, prefill_chunk=4, prefix_cache_mb=8, checkpoint_interval=8
    )
    return plain, cached


def test_batched_prompts_resume_from_the_cache_with_plain_tokens(models: tuple[LLM, LLM]) -> None:
    plain, cached = models
    prompts = [SYSTEM + tokens(10 + k, 3 + k) for k in range(4)]
    want = [plain.generate(p, GREEDY).token_ids for p in prompts]
    first = cached.generate(prompts, GREEDY)
    assert [r.token_ids for r in first] == want
    assert first[0].stats["cached_tokens"] == 0  # nothing was cached before the first prompt
    again = cached.generate(prompts, GREEDY)
    assert [r.token_ids for r in again] == want
    # an exact repeat resumes before its last token (the end of every prompt is checkpointed)
    assert [r.stats["cached_tokens"] for r in again] == [len(p) - 1 for p in prompts]
    # a finished row was cached from its batch row: its continuation resumes after the reply
    follow = prompts[1] + want[1] + tokens(30, 4)
    got = cached.generate([follow], GREEDY)[0]
    assert got.token_ids == plain.generate(follow, GREEDY).token_ids
    assert got.stats["cached_tokens"] == len(prompts[1]) + len(want[1]) - 1


def test_a_corrupted_entry_restored_by_the_scheduler_changes_the_output(models: tuple[LLM, LLM]) -> None:
    """Negative control: the engine's prefill really starts from what the cache restores."""
    plain, cached = models
    cache = cached.prefix_cache
    assert cache is not None
    prompt = SYSTEM + tokens(40, 5)
    cached.generate([prompt], GREEDY)
    path = [node for node, _ in cache._walk(np.asarray(prompt)).path]
    if cache.hybrid:
        node = next(n for n in path if n.end == len(prompt) - 1)
        assert node.checkpoint is not None
        node.checkpoint = [np.full_like(a, 0.5) for a in node.checkpoint]
    else:
        for node in path:
            node.kv = [np.full_like(a, 0.5) for a in node.kv]
    got = cached.generate([prompt], GREEDY)[0]
    assert got.stats["cached_tokens"] == len(prompt) - 1
    assert got.token_ids != plain.generate(prompt, GREEDY).token_ids


def test_a_failing_cache_never_fails_a_request(
    models: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, cached = models
    cache = cached.prefix_cache
    assert cache is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("broken cache")

    monkeypatch.setattr(cache, "lookup", broken)
    monkeypatch.setattr(cache, "insert_arrays", broken)
    prompt = SYSTEM + tokens(50, 6)
    got = cached.generate([prompt], GREEDY)[0]
    assert got.token_ids == plain.generate(prompt, GREEDY).token_ids
    assert got.stats["cached_tokens"] == 0
