"""The state after a verify of k drafts and a commit of j of them, compared with a fresh run.

What "fresh run" means for bit-identity: kernels may round a row differently depending on how many rows
a forward has (one-row GEMV against multi-row GEMM), so the reference must feed the same token groups
the engine fed. Per commit strategy:

- replay (strategy (a); hybrids whose session has no verify plan, or whose plan declines): the snapshot
  taken before the verify is restored and ``[pending] + drafts[:j]`` replayed in one forward (after a full
  accept nothing is replayed: the verify itself fed exactly those tokens). Reference: ``prefill(base)``
  then one forward over ``[pending] + drafts[:j]``; KV and recurrent states bit-identical.
- rewind (dense): the KV cache keeps ``base + j + 1`` rows, written by the verify forward over
  ``[pending] + drafts``. Reference: ``prefill(base)`` then that forward, truncated; bit-identical. A fresh
  forward over only the kept tokens agrees to float32 rounding.
- plan (strategies (b)/(c), :mod:`onnxgen.runtime.state_commit`): KV rewound as for dense (bit-identical
  to the truncated verify); the states after position j come from inside the verify forward, which no
  fresh run reproduces bit for bit, so they are compared to the fresh run over the kept tokens to float32
  rounding, and bit for bit after a full accept (j = k: the verify's own final states).
"""

from __future__ import annotations

import numpy as np
import pytest
from speculative_helpers import (
    DENSE_FAMILIES,
    HYBRID_FAMILIES,
    PROMPT,
    ModelZoo,
    fresh_state,
    greedy,
    mismatches,
)

from onnxgen import SamplingParams
from onnxgen.generation.speculative.loop import SpeculativeLoop
from onnxgen.runtime.buffers import HostBuffer
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

K = 4
CAPACITY = 64
ROUNDING = 1e-5
CASES = [
    *[(family, "rewind") for family in DENSE_FAMILIES],
    *[(family, s) for family in HYBRID_FAMILIES for s in ("replay", "plan", "plan-declined")],
]


class ScriptedProposer:
    """Proposes the given drafts once, then nothing."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.prompt_len = -1

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], None]:
        drafts, self.drafts = self.drafts[:k], []
        return drafts, None

    def observe(self, context_len: int, accepted: int) -> None:
        pass

    def reset(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len


def use_strategy(monkeypatch: pytest.MonkeyPatch, session: DecoderSession, strategy: str) -> None:
    plan = getattr(session, "verify_plan", None)
    if strategy == "replay":
        monkeypatch.setattr(session, "verify_plan", None, raising=False)
    elif strategy.startswith("plan"):
        if plan is None:
            pytest.skip("this session has no verify plan")
        if strategy == "plan-declined":  # e.g. a state window shorter than the verify: replay instead
            monkeypatch.setattr(plan, "commit", lambda *args, **kwargs: False)


def drafts_with_j_right(plain: list[int], j: int) -> list[int]:
    """k drafts after the pending token plain[0]: the first j are plain greedy's, draft j (if any) is not."""
    drafts = list(plain[1 : 1 + K])
    if j < K:
        drafts[j] = (drafts[j] + 1) % 320
    return drafts


def verify_and_commit(zoo: ModelZoo, family: str, j: int) -> tuple[SpeculativeLoop, int, list[int]]:
    """Prefill PROMPT, emit the pending token, verify k scripted drafts, commit; (loop, pending, drafts)."""
    llm = zoo.llm(family)
    plain = greedy(llm, PROMPT, K + 2).token_ids
    drafts = drafts_with_j_right(plain, j)
    proposer = ScriptedProposer(drafts)
    state = llm.session.new_state(CAPACITY)
    params = SamplingParams(max_new_tokens=20)
    loop = SpeculativeLoop(llm.session, state, PROMPT, params, (), proposer, K, adaptive=False)
    assert proposer.prompt_len == len(PROMPT)
    tokens = loop.tokens()
    pending, _ = next(tokens)
    assert pending == plain[0]
    emitted, _ = next(tokens)  # the verify and its commit ran before the first token it emits
    assert emitted == plain[1]
    assert (loop.proposed, loop.accepted) == (K, j), "the scripted drafts did not give the intended accept"
    return loop, pending, drafts


def commit_mismatches(
    session: DecoderSession, strategy: str, state: DecodeState, pending: int, drafts: list[int], j: int
) -> list[str]:
    """Where ``state`` differs from its strategy's reference (module docstring): bit for bit, except the
    states a plan commits before a full accept, which must agree to float32 rounding."""
    kept = fresh_state(session, [PROMPT, [pending, *drafts[:j]]], CAPACITY)
    if strategy in ("replay", "plan-declined"):
        return [
            *mismatches(state.kv_arrays(), kept.kv_arrays()),
            *mismatches(state.state_arrays(), kept.state_arrays()),
        ]
    whole = fresh_state(session, [PROMPT, [pending, *drafts]], CAPACITY)
    keep = len(PROMPT) + 1 + j
    truncated = {name: kv[:, :, :keep] for name, kv in whole.kv_arrays().items()}
    found = list(mismatches(state.kv_arrays(), truncated))
    if j == K:
        found += mismatches(state.state_arrays(), whole.state_arrays())
    else:
        found += mismatches(state.state_arrays(), kept.state_arrays(), atol=ROUNDING)
    return found


@pytest.mark.parametrize("j", [0, 1, K])
@pytest.mark.parametrize(("family", "strategy"), CASES)
def test_a_commit_of_j_drafts_leaves_kv_and_states_bit_identical_to_the_fresh_run_of_its_strategy(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str, strategy: str, j: int
) -> None:
    session = zoo.llm(family).session
    use_strategy(monkeypatch, session, strategy)
    loop, pending, drafts = verify_and_commit(zoo, family, j)
    state = loop.state
    assert state.length == len(PROMPT) + 1 + j
    assert bool(state.state_arrays()) == (family in HYBRID_FAMILIES)
    replays = 1 if strategy in ("replay", "plan-declined") and j < K else 0
    assert loop.replays == replays
    assert loop.forward_passes == 2 + replays
    assert commit_mismatches(session, strategy, state, pending, drafts, j) == []


@pytest.mark.parametrize("j", [0, 1, 2])
@pytest.mark.parametrize(("family", "strategy"), [c for c in CASES if c[1] in ("rewind", "plan")])
def test_a_commit_without_replay_agrees_to_rounding_with_a_fresh_forward_over_only_the_kept_tokens(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str, strategy: str, j: int
) -> None:
    session = zoo.llm(family).session
    use_strategy(monkeypatch, session, strategy)
    loop, pending, drafts = verify_and_commit(zoo, family, j)
    kept = fresh_state(session, [PROMPT, [pending, *drafts[:j]]], CAPACITY)
    for ours, theirs in (
        (loop.state.kv_arrays(), kept.kv_arrays()),
        (loop.state.state_arrays(), kept.state_arrays()),
    ):
        assert ours.keys() == theirs.keys()
        for name, value in ours.items():
            np.testing.assert_allclose(value, theirs[name], rtol=0, atol=ROUNDING, err_msg=name)


@pytest.mark.parametrize("j", [0, 1])
@pytest.mark.parametrize(("family", "strategy"), CASES)
def test_the_commit_comparison_fails_when_the_state_is_not_brought_back(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str, strategy: str, j: int
) -> None:
    # Negative control: skip the step that brings the state back and the same comparison must fail.
    session = zoo.llm(family).session
    use_strategy(monkeypatch, session, strategy)
    if strategy == "plan":  # commit the KV length but keep the states the whole verify left
        commit = DecodeState.commit

        def kv_only(self: DecodeState, length: int, states: list[HostBuffer]) -> None:
            for buf, current in zip(states, self.state_arrays().values(), strict=True):
                np.copyto(buf.array, current)
            commit(self, length, states)

        monkeypatch.setattr(DecodeState, "commit", kv_only)
    else:
        skipped = "rewind" if strategy == "rewind" else "restore"
        monkeypatch.setattr(DecodeState, skipped, lambda self, *args: None)
    loop, pending, drafts = verify_and_commit(zoo, family, j)
    assert commit_mismatches(session, strategy, loop.state, pending, drafts, j) != []
