"""Generator through LLM: greedy and seeded decoding, eos, stop strings, lengths, streaming, stats, bad prompts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen import GenerationError, SamplingParams
from onnxgen.llm import LLM
from onnxgen.model import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import build_model, special_token_ids

FAMILIES = ("genai-dense", "hybrid-genai")
PROMPT = "The quick brown fox"
N = 24


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generator")
    return {family: build_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def llms(model_dirs: dict[str, Path]) -> dict[str, LLM]:
    return {family: onnxgen.load(path, threads=1) for family, path in model_dirs.items()}


@pytest.fixture(params=FAMILIES)
def llm(request: pytest.FixtureRequest, llms: dict[str, LLM]) -> LLM:
    return llms[request.param]


def greedy(max_new_tokens: int = N, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


def plain_greedy_loop(model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding written out over DecoderSession.forward (a fresh session and state)."""
    package = ModelPackage.open(model_dir)
    session = DecoderSession(session_graph(package.model_path, package.io), threads=1)
    state = session.new_state(len(prompt) + steps)
    logits = session.forward(state, np.asarray([prompt]))[0, -1]
    out: list[int] = []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == steps:
            return out
        logits = session.forward(state, np.asarray([[out[-1]]]))[0, -1]


def count_forwards(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[int]:
    """Wrap the session's forward and decode step; the returned list grows by one entry per forward."""
    calls: list[int] = []
    for name in ("forward", "step"):
        inner: Callable[..., np.ndarray] = getattr(llm.session, name)

        def counted(*args: Any, _inner: Callable[..., np.ndarray] = inner, **kw: Any) -> np.ndarray:
            calls.append(1)
            return _inner(*args, **kw)

        monkeypatch.setattr(llm.session, name, counted)
    return calls


# -- greedy and seeded decoding ---------------------------------------------------------------------
def test_greedy_generation_equals_a_plain_argmax_loop_over_the_session(
    llm: LLM, model_dirs: dict[str, Path]
) -> None:
    family = next(f for f, path in model_dirs.items() if path == llm.package.root)
    prompt = llm.encode(PROMPT)
    result = llm.generate(PROMPT, greedy())
    assert result.token_ids == plain_greedy_loop(model_dirs[family], prompt, N)
    assert result.finish_reason == "length"
    assert result.text == llm.tokenizer.decode(result.token_ids)  # type: ignore[union-attr]


def test_greedy_generation_is_deterministic_across_requests_of_other_lengths(llm: LLM) -> None:
    first = llm.generate(PROMPT, greedy())
    llm.generate("def f(x):\n    return x" * 3, greedy(40))  # a longer request in between
    llm.generate("Hi", greedy(3))  # and a shorter one, reusing the state
    again = llm.generate(PROMPT, greedy())
    assert again.token_ids == first.token_ids and again.text == first.text
    assert len(set(first.token_ids)) > 5


def test_token_id_prompts_give_the_same_result_as_the_text_they_encode(llm: LLM) -> None:
    ids = llm.encode(PROMPT)
    assert llm.generate(ids, greedy(8)).token_ids == llm.generate(PROMPT, greedy(8)).token_ids


def test_the_same_seed_samples_the_same_tokens_and_other_seeds_other_tokens(llm: LLM) -> None:
    def sample(seed: int) -> list[int]:
        return llm.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=1.5, seed=seed)).token_ids

    runs = {seed: sample(seed) for seed in (1, 2, 3)}
    assert sample(1) == runs[1]
    assert runs[1] != runs[2] and runs[2] != runs[3] and runs[1] != runs[3]
    assert runs[1] != llm.generate(PROMPT, greedy(16)).token_ids[: len(runs[1])]


# -- eos, lengths -----------------------------------------------------------------------------------
def test_the_loaded_model_ends_on_the_eos_ids_of_its_configs(llm: LLM) -> None:
    specials = special_token_ids(llm.session.vocab_size)
    assert set(llm.eos_token_ids) == {specials["<|endoftext|>"], specials["<|im_end|>"]}


def first_new_token(tokens: list[int], start: int) -> tuple[int, int]:
    """(k, token): the 1-based step k >= start whose greedy token has not appeared before it."""
    for k in range(start, len(tokens) + 1):
        if tokens[k - 1] not in tokens[: k - 1]:
            return k, tokens[k - 1]
    raise AssertionError(f"no fresh token after step {start} in {tokens}")


def test_an_eos_token_ends_generation_with_finish_reason_stop_at_its_step(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = llm.generate(PROMPT, greedy()).token_ids
    k, token = first_new_token(reference, 5)
    monkeypatch.setattr(llm.generator, "eos_ids", (token,))
    calls = count_forwards(monkeypatch, llm)
    result = llm.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert result.finish_reason == "stop"
    assert result.token_ids == reference[:k]
    assert len(calls) == k == result.stats["forward_passes"] == result.stats["generated_tokens"]


def test_ignore_eos_generates_through_eos_tokens_to_max_new_tokens(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = llm.generate(PROMPT, greedy()).token_ids
    _, token = first_new_token(reference, 3)
    monkeypatch.setattr(llm.generator, "eos_ids", (token,))
    result = llm.generate(PROMPT, greedy())
    assert result.finish_reason == "length"
    assert result.token_ids == reference


def test_min_new_tokens_keeps_eos_from_ending_generation_early(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = llm.generate(PROMPT, greedy()).token_ids
    k, token = first_new_token(reference, 3)
    monkeypatch.setattr(llm.generator, "eos_ids", (token,))
    result = llm.generate(PROMPT, SamplingParams(max_new_tokens=N, min_new_tokens=k + 2))
    assert token not in result.token_ids[: k + 2]
    assert len(result.token_ids) > k + 2 or result.finish_reason == "length"
    assert result.token_ids[: k - 1] == reference[: k - 1]  # identical until the masked eos


@pytest.mark.parametrize("max_new_tokens", [1, 5])
def test_max_new_tokens_ends_generation_with_finish_reason_length(llm: LLM, max_new_tokens: int) -> None:
    result = llm.generate(PROMPT, greedy(max_new_tokens))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == max_new_tokens
    assert result.token_ids == llm.generate(PROMPT, greedy()).token_ids[:max_new_tokens]


# -- stop strings -----------------------------------------------------------------------------------
@pytest.fixture
def pieces(llm: LLM) -> tuple[list[int], list[str]]:
    """The greedy tokens and the text each stream event carried."""
    events = list(llm.stream(PROMPT, greedy()))
    return [e.token_ids[0] for e in events], [e.text for e in events]


def expected_stop(tokens: list[int], texts: list[str], stop: str) -> tuple[list[int], str]:
    """Tokens up to the event whose text completes ``stop``, and the text before ``stop``."""
    full = "".join(texts)
    for k in range(len(texts)):
        if stop in "".join(texts[: k + 1]):
            return tokens[: k + 1], full[: full.index(stop)]
    raise AssertionError(f"{stop!r} is not in {full!r}")


def pick_stop(texts: list[str], across: bool) -> str:
    """A stop string from the greedy text, first seen at event >= 4: one event's text, or spanning two."""
    full = "".join(texts)
    for k in range(4, len(texts)):
        before = "".join(texts[:k])
        stop = (before[-1] + texts[k][0]) if across and before and texts[k] else texts[k]
        start = len(before) - 1 if across else len(before)
        if stop and "\ufffd" not in stop and full.find(stop) == start:
            return stop
    raise AssertionError(f"no usable stop string in {texts!r}")


@pytest.mark.parametrize("across", [False, True], ids=["in-one-token", "across-tokens"])
def test_a_stop_string_ends_generation_at_its_token_and_is_left_out_of_the_text(
    llm: LLM, pieces: tuple[list[int], list[str]], across: bool
) -> None:
    tokens, texts = pieces
    stop = pick_stop(texts, across)
    want_ids, want_text = expected_stop(tokens, texts, stop)
    result = llm.generate(PROMPT, greedy(stop=["\x00never\x00", stop]))
    assert result.finish_reason == "stop"
    assert result.token_ids == want_ids
    assert result.text == want_text and stop not in result.text
    assert len(want_ids) < N


def test_a_stop_string_that_never_completes_releases_the_held_back_text_at_the_end(
    llm: LLM, pieces: tuple[list[int], list[str]]
) -> None:
    tokens, texts = pieces
    full = "".join(texts)
    stop = full[-1] + "\x00\x00"  # the last character could start it, so it is held back until the end
    result = llm.generate(PROMPT, greedy(stop=stop))
    assert result.finish_reason == "length"
    assert result.token_ids == tokens and result.text == full


# -- streaming --------------------------------------------------------------------------------------
def test_stream_yields_each_token_as_soon_as_its_forward_has_run(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_forwards(monkeypatch, llm)
    stream = llm.stream(PROMPT, greedy(10))
    assert calls == []  # nothing runs before the first event is asked for
    seen = 0
    for event in stream:
        seen += 1
        assert len(calls) == seen, "the stream ran ahead of its consumer"
        assert len(event.token_ids) == 1
        assert (event.finish_reason is None) == (seen < 10)
        assert (event.stats is None) == (seen < 10)
    assert seen == 10


def test_the_concatenated_stream_equals_the_generate_result(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=N, temperature=0.8, seed=7)
    events = list(llm.stream(PROMPT, params))
    result = llm.generate(PROMPT, params)
    assert [t for e in events for t in e.token_ids] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    assert events[-1].finish_reason == result.finish_reason


def test_two_interleaved_streams_each_give_what_they_give_alone(llm: LLM) -> None:
    params = greedy(12)
    other = "def f(x):"
    alone = (llm.generate(PROMPT, params).token_ids, llm.generate(other, params).token_ids)
    a_ids: list[int] = []
    b_ids: list[int] = []
    for a, b in zip(llm.stream(PROMPT, params), llm.stream(other, params), strict=True):
        a_ids += a.token_ids
        b_ids += b.token_ids
    assert (a_ids, b_ids) == alone


def test_an_abandoned_stream_does_not_disturb_the_next_request(llm: LLM) -> None:
    expected = llm.generate(PROMPT, greedy(8)).token_ids
    stream: Iterator[Any] = llm.stream("def f(x):", greedy(20))
    next(stream)
    next(stream)
    assert llm.generate(PROMPT, greedy(8)).token_ids == expected
    del stream


def test_requests_on_parallel_threads_give_what_they_give_alone(llm: LLM) -> None:
    prompts = [PROMPT, "def f(x):", "Hello world", "import numpy as np"]
    params = greedy(40)
    alone = [llm.generate(p, params).token_ids for p in prompts]
    together: list[list[int]] = [[] for _ in prompts]

    def work(i: int) -> None:
        together[i] = llm.generate(prompts[i], params).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


# -- stats ------------------------------------------------------------------------------------------
def test_stats_count_prompt_tokens_generated_tokens_and_forwards_with_plausible_timings(llm: LLM) -> None:
    result = llm.generate(PROMPT, greedy(12))
    stats = result.stats
    assert stats["prompt_tokens"] == len(llm.encode(PROMPT))
    assert stats["generated_tokens"] == len(result.token_ids) == 12
    assert stats["forward_passes"] == 12  # one prefill + 11 decode steps
    assert 0 < stats["ttft_s"] <= stats["total_s"] < 30
    assert stats["decode_tok_s"] > 0
    # 11 decode steps in (total - ttft) seconds, give or take the last step's bookkeeping
    assert stats["decode_tok_s"] == pytest.approx(11 / (stats["total_s"] - stats["ttft_s"]), rel=0.5)


# -- bad prompts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["", []], ids=["empty-text", "no-ids"])
def test_an_empty_prompt_is_refused(llm: LLM, prompt: Any) -> None:
    with pytest.raises(GenerationError, match="prompt is empty"):
        llm.generate(prompt, greedy(4))
    with pytest.raises(GenerationError, match="prompt is empty"):
        llm.stream(prompt, greedy(4))


@pytest.mark.parametrize("bad", [320, 10_000, -1])
def test_token_ids_outside_the_vocabulary_are_refused_naming_them(llm: LLM, bad: int) -> None:
    with pytest.raises(GenerationError, match=rf"\[{bad}\].*\[0, 320\)"):
        llm.generate([5, bad, 7], greedy(4))
    with pytest.raises(GenerationError, match=rf"\[{bad}\]"):
        llm.stream([5, bad, 7], greedy(4))
    assert llm.generate([5, 7], greedy(2)).finish_reason == "length"  # and the model goes on
