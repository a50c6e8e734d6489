"""The forward observer (onnxgen.runtime.observer): it sees every forward of a generate, with its phase and
shape, and costs the hot path one attribute test when none is installed."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

import onnxgen
from onnxgen import SamplingParams
from onnxgen.generation.speculative import PromptLookup
from onnxgen.llm import LLM
from onnxgen.runtime import batch, session
from onnxgen.runtime.observer import ForwardEvent
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import build_model

PROMPT = [5, 17, 200, 33, 44, 91, 12, 8]


@pytest.fixture(scope="module", params=["genai-dense", "hybrid-genai"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir = build_model(tmp_path_factory.mktemp("observer") / request.param, request.param)
    return onnxgen.load(model_dir, threads=1)


def observed(llm: LLM) -> list[ForwardEvent]:
    events: list[ForwardEvent] = []
    llm.session.forward_observer = events.append
    return events


def test_a_generate_reports_its_prefill_and_every_decode_step(llm: LLM) -> None:
    events = observed(llm)
    try:
        result = llm.generate(PROMPT, SamplingParams(max_new_tokens=12, min_new_tokens=12, temperature=0))
    finally:
        llm.session.forward_observer = None
    assert len(result.token_ids) == 12
    assert [e.phase for e in events] == ["prefill"] + ["decode"] * 11  # the first token is the prefill's
    assert (events[0].batch, events[0].tokens, events[0].past) == (1, len(PROMPT), 0)
    assert [e.past for e in events[1:]] == list(range(len(PROMPT), len(PROMPT) + 11))
    assert all(e.tokens == 1 and e.batch == 1 and e.seconds > 0 for e in events[1:])
    assert len(events) == result.stats["forward_passes"]
    assert llm.session.lane_steps > 0  # steps on the prepared lane are reported too


def test_speculative_verifies_are_reported_as_verify(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0)).token_ids
    prompt = [*PROMPT, *out, *PROMPT, *out[:4]]  # its end repeats an earlier span: prompt lookup drafts
    events = observed(llm)
    try:
        result = llm.generate(
            prompt,
            SamplingParams(max_new_tokens=16, min_new_tokens=16, temperature=0),
            speculative=PromptLookup(num_draft_tokens=3),
        )
    finally:
        llm.session.forward_observer = None
    verifies = [e for e in events if e.phase == "verify"]
    assert verifies, "prompt lookup drafted nothing to verify"
    assert all(e.tokens > 1 for e in verifies)
    assert events[0].phase == "prefill"
    assert len(events) == result.stats["target_forward_passes"]


def test_a_batched_generate_reports_steps_of_several_rows(llm: LLM) -> None:
    events = observed(llm)
    try:
        results = llm.generate([PROMPT, PROMPT[:5]], SamplingParams(max_new_tokens=6, temperature=0))
    finally:
        llm.session.forward_observer = None
    assert len(results) == 2
    assert [e.tokens for e in events if e.phase == "prefill"] == [len(PROMPT), 5]
    assert max(e.batch for e in events if e.phase == "decode") == 2


def test_without_an_observer_nothing_is_built(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no observer, no event is made (the constructor would raise) and generation runs as before."""

    def refuse(*args: object) -> None:
        raise AssertionError("an event was made with no observer installed")

    monkeypatch.setattr(session, "ForwardEvent", refuse)
    monkeypatch.setattr(batch, "ForwardEvent", refuse)
    assert llm.session.forward_observer is None
    params = SamplingParams(max_new_tokens=8, temperature=0)
    assert len(llm.generate(PROMPT, params).token_ids) == 8
    assert len(llm.generate([PROMPT, PROMPT[:5]], params)) == 2


def _attribute_reads(function: object, name: str) -> int:
    source = textwrap.dedent(inspect.getsource(function))  # type: ignore[arg-type]
    return sum(isinstance(n, ast.Attribute) and n.attr == name for n in ast.walk(ast.parse(source)))


def test_the_hot_path_checks_the_observer_with_one_attribute_test() -> None:
    """Structurally: a lane step reads ``forward_observer`` once (in the lane-step bookkeeping it already
    calls), the class's forward once before the unobserved forward it runs, a batched step once; the
    unobserved bodies never."""
    assert _attribute_reads(DecoderSession.step, "forward_observer") == 0
    assert _attribute_reads(DecoderSession._count_lane_step, "forward_observer") == 1
    assert _attribute_reads(DecoderSession.forward, "forward_observer") == 1
    assert _attribute_reads(DecoderSession._forward, "forward_observer") == 0
    assert _attribute_reads(batch.BatchState.step, "forward_observer") == 1
    assert _attribute_reads(batch.BatchState._step, "forward_observer") == 0
