"""Token log-probabilities: the helper on synthetic rows, parameter checks, and end to end against the
numpy ground truth of a tiny model's logits (plain, sampled, processed, speculative)."""

from __future__ import annotations

import numpy as np
import pytest

import onnxgen
from onnxgen import SamplingParams
from onnxgen.generation import logprobs as logprobs_module
from onnxgen.generation.logprobs import log_softmax, token_logprob
from onnxgen.generation.params import SamplingParamsError
from onnxgen.generation.speculative import DraftModel
from onnxgen.llm import LLM
from onnxgen.testing import TinySpec, build_model, make_weights, reference_logits

SPEC = TinySpec()
PROMPT = [5, 17, 42, 42, 99, 7, 5, 17, 42]


def test_log_softmax_of_a_row_with_masked_entries() -> None:
    row = np.array([0.0, np.log(3.0), -np.inf, np.log(4.0)], dtype=np.float32)
    got = log_softmax(row)
    assert got[2] == -np.inf
    np.testing.assert_allclose(np.exp(got), [1 / 8, 3 / 8, 0.0, 4 / 8], rtol=1e-6)


def test_top_logprobs_are_best_first_with_ties_to_the_lower_id() -> None:
    row = np.array([1.0, 3.0, 3.0, -np.inf, 2.0, 3.0], dtype=np.float32)
    scored = token_logprob(row, 4, top=4)
    lse = np.log(np.exp(1.0) + 3 * np.exp(3.0) + np.exp(2.0))
    assert scored.token_id == 4 and scored.logprob == pytest.approx(2.0 - lse)
    assert [t for t, _ in scored.top] == [1, 2, 5, 4]
    assert [t for t, _ in token_logprob(row, 0, top=2).top] == [1, 2]  # the tie at the cut: lowest ids
    assert token_logprob(row, 3, top=6).top[-1] == (3, -np.inf)
    assert token_logprob(row, 0).top == ()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in \\[0, 20\\]"),
        ({"top_logprobs": 3}, "logprobs must be True when top_logprobs is given"),
        ({"logprobs": True, "logprobs_mode": "softmax"}, "logprobs_mode must be one of raw, processed"),
        ({"logprobs": 1}, "logprobs must be a bool"),
    ],
)
def test_invalid_logprob_parameters_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return onnxgen.load(build_model(tmp_path_factory.mktemp("lp") / "m", "genai-dense", SPEC), threads=1)


def reference(ids: list[int]) -> np.ndarray:
    """Log-softmax of the ground-truth logits: row i scores the token after ids[: i + 1]."""
    logits = reference_logits(SPEC, make_weights(SPEC), ids)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def check_against_reference(result: onnxgen.GenerationResult, top: int) -> None:
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    ref = reference(PROMPT + result.token_ids)[len(PROMPT) - 1 : -1]
    for row, token, scored in zip(ref, result.token_ids, result.logprobs, strict=True):
        assert scored.token_id == token
        assert scored.logprob == pytest.approx(row[token], abs=2e-4)
        best = np.argsort(-row, kind="stable")[:top]
        assert [t for t, _ in scored.top] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in scored.top], row[best], atol=2e-4)


def test_greedy_logprobs_agree_with_the_log_softmax_of_the_model_logits(llm: LLM) -> None:
    result = llm.generate(PROMPT, SamplingParams(max_new_tokens=12, logprobs=True, top_logprobs=5))
    check_against_reference(result, 5)
    assert all(s.top[0][0] == s.token_id for s in result.logprobs or [])  # greedy picks the best
    plain = llm.generate(PROMPT, SamplingParams(max_new_tokens=12))
    assert plain.token_ids == result.token_ids and plain.logprobs is None  # same tokens, nothing extra
    # negative control: the scores of the next position do not match
    shifted = reference(PROMPT + result.token_ids)[len(PROMPT) : len(PROMPT) + 1]
    assert shifted[0][result.token_ids[0]] != pytest.approx((result.logprobs or [])[0].logprob, abs=2e-4)


def test_sampled_logprobs_are_the_raw_model_distribution_by_default(llm: LLM) -> None:
    params = SamplingParams(
        max_new_tokens=10, temperature=1.7, top_k=8, seed=3, logprobs=True, top_logprobs=3
    )
    result = llm.generate(PROMPT, params)
    check_against_reference(result, 3)  # temperature and top-k do not change what is reported
    assert (
        result.token_ids
        == llm.generate(
            PROMPT, SamplingParams(**{**params.__dict__, "logprobs": False, "top_logprobs": 0})
        ).token_ids
    )


def test_processed_logprobs_are_the_distribution_sampled_from(llm: LLM) -> None:
    temperature = 0.5
    params = SamplingParams(
        max_new_tokens=8,
        temperature=temperature,
        top_k=4,
        seed=1,
        logprobs=True,
        top_logprobs=6,
        logprobs_mode="processed",
    )
    result = llm.generate(PROMPT, params)
    assert (
        result.token_ids
        == llm.generate(
            PROMPT, SamplingParams(max_new_tokens=8, temperature=temperature, top_k=4, seed=1)
        ).token_ids
    )
    logits = reference_logits(SPEC, make_weights(SPEC), PROMPT + result.token_ids)[len(PROMPT) - 1 : -1]
    for row, scored in zip(logits, result.logprobs or [], strict=True):
        kept = np.argsort(-row, kind="stable")[:4]
        scaled = np.full_like(row, -np.inf)
        scaled[kept] = row[kept] / temperature
        expected = scaled - np.logaddexp.reduce(scaled[kept])
        assert scored.logprob == pytest.approx(expected[scored.token_id], abs=5e-4)
        assert [t for t, _ in scored.top][:4] == kept.tolist()
        assert all(lp == -np.inf for _, lp in scored.top[4:])  # outside top-k: masked


def test_speculative_decoding_reports_the_same_logprobs(llm: LLM) -> None:
    """The model drafts for itself, so drafts are accepted and scores come from verify rows."""
    params = SamplingParams(max_new_tokens=16, logprobs=True, top_logprobs=2)
    plain = llm.generate(PROMPT, params)
    fast = llm.generate(PROMPT, params, speculative=DraftModel(llm, num_draft_tokens=3))
    assert fast.token_ids == plain.token_ids
    assert fast.stats["accepted_draft_tokens"] > 0
    for a, b in zip(fast.logprobs or [], plain.logprobs or [], strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    penalized = SamplingParams(
        max_new_tokens=12, repetition_penalty=1.5, logprobs=True, top_logprobs=2, logprobs_mode="processed"
    )
    plain = llm.generate(PROMPT, penalized)
    fast = llm.generate(PROMPT, penalized, speculative=DraftModel(llm, num_draft_tokens=3))
    assert fast.stats["accepted_draft_tokens"] > 0 and fast.token_ids == plain.token_ids
    raw = llm.generate(PROMPT, SamplingParams(**{**penalized.__dict__, "logprobs_mode": "raw"}))
    for a, b in zip(fast.logprobs or [], plain.logprobs or [], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert any(  # the penalty shows in the processed scores
        abs(b.logprob - c.logprob) > 1e-3
        for b, c in zip(plain.logprobs or [], raw.logprobs or [], strict=True)
    )
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, logprobs=True, top_logprobs=2)
    result = llm.generate(PROMPT, sampled, speculative=DraftModel(llm, num_draft_tokens=3))
    assert result.stats["accepted_draft_tokens"] > 0
    check_against_reference(result, 2)


def test_streamed_events_carry_one_score_per_token(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=6, logprobs=True)
    events = list(llm.stream(PROMPT, params))
    assert all(e.logprobs is not None and len(e.logprobs) == len(e.token_ids) for e in events)
    assert [e.logprobs[0].logprob for e in events if e.logprobs] == [
        s.logprob for s in llm.generate(PROMPT, params).logprobs or []
    ]


def test_nothing_is_scored_unless_asked(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(logprobs_module, "log_softmax", lambda *a, **k: calls.append(1))
    llm.generate(PROMPT, SamplingParams(max_new_tokens=5, temperature=1.0, seed=0))
    llm.generate(PROMPT, SamplingParams(max_new_tokens=5), speculative=DraftModel(llm, num_draft_tokens=2))
    assert calls == []
    with pytest.raises(TypeError):  # the control: asking for logprobs does reach the patched function
        llm.generate(PROMPT, SamplingParams(max_new_tokens=2, logprobs=True))
    assert calls
