"""MTP speculation on the decode lanes: plain steps that hand the head its hidden state run on a lane of
their own (as cheap as plain decoding's), ``auto``'s plain decoding after it turns drafting off runs on
the plain lanes, and the head is loaded with the model when speculation is asked for at load."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mtp_helpers import MTPZoo, build_mtp_model
from speculative_helpers import PROMPT, assert_same_as_plain, greedy, ids

import onnxgen
from onnxgen import MTP, SamplingParams
from onnxgen.generation.speculative import loop
from onnxgen.runtime import mtp_head
from onnxgen.runtime.session import DecoderSession

TOKENS = [3, 99, 250, 7, 11, 42, 5, 8, 120, 64]


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_fetching_steps_run_on_a_lane_and_hand_over_what_the_forward_path_gives(
    mtp_zoo: MTPZoo, family: str
) -> None:
    session = mtp_zoo.llm(family).session
    assert session.hidden_state is not None
    fetch = (session.hidden_state,)
    lane, reference = session.new_state(64), session.new_state(64)
    session.forward(lane, ids(PROMPT), 1)
    session.forward(reference, ids(PROMPT), 1)
    before = session.lane_steps
    hidden: list[np.ndarray] = []
    for token in TOKENS:
        got: dict[str, Any] = {}
        logits = session.step(lane, token, fetch=fetch, fetched=got).copy()
        want: dict[str, Any] = {}
        # the class's forward with a fetch on another state: the path without a lane
        expected = DecoderSession.forward(session, reference, ids([token]), 1, fetch=fetch, fetched=want)
        assert np.array_equal(logits, expected[0, -1])
        hidden.append(got[fetch[0]].numpy().copy())
        assert np.array_equal(hidden[-1], want[fetch[0]].numpy())
    # the first step of each parity makes the lane (two forwards on the fetch binders), the rest take it
    assert session.lane_steps - before >= len(TOKENS) - 4
    # negative control: a lane that handed over a stale buffer would repeat a step's hidden state
    assert not any(np.array_equal(a, b) for a, b in pairwise(hidden))


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_back_off_steps_while_speculating_and_plain_steps_after_auto_turns_off_take_lanes(
    mtp_zoo: MTPZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    # drafts almost never accepted: back-off runs of 1, 2, 4, 8 steps
    llm = mtp_zoo.llm(family, head="random")
    # auto turns drafting off at its first decision whatever the timings (on a tiny model they are noise);
    # a fixed draft count keeps the one verify size timed, so that the decision is made then
    monkeypatch.setattr(loop, "AUTO_MIN_GAIN", float("inf"))
    n = 40
    plain = greedy(llm, PROMPT, n)
    for auto in (False, True):
        before = llm.session.lane_steps
        result = llm.generate(
            PROMPT,
            SamplingParams(max_new_tokens=n),
            speculative=MTP(num_draft_tokens=2, auto=auto, adaptive=False),
        )
        assert_same_as_plain(llm.session, PROMPT, plain.token_ids, result.token_ids)
        lanes = llm.session.lane_steps - before
        if auto:
            # auto stopped drafting after a few verifies: plain decoding on the plain lanes from there
            assert result.stats["speculation"] == f"off after {loop.AUTO_MIN_VERIFIES} verifies", result.stats
            assert lanes >= n // 2, (lanes, result.stats)
        else:
            # back-off runs of 4, 8, 16 plain steps between verifies: all but the first three steps of a
            # run (the one after the verify, the two that make each parity's lane) take a lane
            assert result.stats["accepted_draft_tokens"] == 0
            assert lanes >= n // 4, (lanes, result.stats)


def test_the_head_is_loaded_with_the_model_when_speculation_is_asked_for_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_mtp_model(tmp_path, "genai-dense")
    made: list[object] = []
    init = mtp_head.MTPHeadSession.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(mtp_head.MTPHeadSession, "__init__", counted)
    llm = onnxgen.load(model, threads=1, speculative=True)
    assert len(made) == 1  # at load ...
    llm.generate(PROMPT, SamplingParams(max_new_tokens=6), speculative=MTP(num_draft_tokens=2))
    assert len(made) == 1  # ... and not inside the first MTP request
    lazy = onnxgen.load(model, threads=1)
    assert len(made) == 1  # without speculation asked for, nothing loads the head ...
    lazy.generate(PROMPT, SamplingParams(max_new_tokens=6), speculative=MTP(num_draft_tokens=2))
    assert len(made) == 2  # ... until a request drafts with it
