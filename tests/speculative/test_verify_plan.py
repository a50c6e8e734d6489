"""Speculative commits through a verify plan: captured state-node inputs (c, the default) and per-position
states (b, on request for Scan exports).

"Fresh run" here is the replay of strategy (a): restore the state saved before the verify and run
``[pending] + drafts[:j]`` in one forward, on a session without a plan. The plan's states must equal it bit for
bit, except on the Scan export for j = 0: that replay is a one-token forward, whose one-row Conv and MatMul
kernels round differently from the multi-row verify whose values the plan commits (float32 rounding, 1e-5).
KV caches are the verify's rows either way.
"""

from __future__ import annotations

import numpy as np
import pytest
from speculative_helpers import (
    DENSE_FAMILIES,
    HYBRID_FAMILIES,
    PROMPT,
    ModelZoo,
    NoisyOracle,
    assert_same_as_plain,
    greedy,
    ids,
    mismatches,
)

from onnxgen import SamplingParams, load
from onnxgen.generation.speculative.loop import SpeculativeLoop
from onnxgen.model import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState
from onnxgen.runtime.state_commit import CapturePlan, PerPositionPlan

K = 4
N = 24
CAPACITY = 96


class Scripted(NoisyOracle):
    """Proposes ``drafts`` once, then nothing."""

    def __init__(self, drafts: list[int]) -> None:
        super().__init__([], 0.0, 1)
        self.drafts = drafts

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], None]:
        drafts, self.drafts = self.drafts[:k], []
        return drafts, None


def session_with(zoo: ModelZoo, family: str, verify: bool | str) -> DecoderSession:
    model_dir = zoo.dir(family)
    return DecoderSession(
        session_graph(model_dir / "model.onnx", ModelPackage.open(model_dir).io), threads=1, verify=verify
    )


def replay_session(zoo: ModelZoo, family: str) -> DecoderSession:
    return session_with(zoo, family, False)


def run_loop(
    session: DecoderSession, proposer: NoisyOracle, prompt: list[int], **params: object
) -> tuple[list[int], dict[str, int]]:
    """The tokens and statistics of one speculative run of N tokens."""
    state = session.new_state(len(prompt) + N + 1)
    sampling = SamplingParams(max_new_tokens=N, **params)  # type: ignore[arg-type]
    loop = SpeculativeLoop(session, state, prompt, sampling, (), proposer, K, adaptive=False)
    return [token for token, _ in loop.tokens()], loop.stats()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_sessions_get_the_capture_plan_by_default_and_none_when_replay_is_asked(
    zoo: ModelZoo, family: str
) -> None:
    assert isinstance(zoo.llm(family).session.verify_plan, CapturePlan)
    assert replay_session(zoo, family).verify_plan is None
    assert session_with(zoo, family, "replay").verify_plan is None


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_plan_graph_is_loaded_at_the_first_speculative_verify_and_decoding_goes_on_bit_for_bit(
    zoo: ModelZoo, family: str
) -> None:
    """Its extra outputs cost plain steps too, so a session runs the plain graph until the plan is asked
    for; a decode state then carries on across the switch exactly as on a session that never had a plan."""
    session = session_with(zoo, family, True)
    plain = replay_session(zoo, family)
    n_outputs = len(session.session.get_outputs())
    assert n_outputs == len(plain.session.get_outputs())
    state, ref = session.new_state(40), plain.new_state(40)
    prompt = np.array([PROMPT])
    for i in range(6):
        ids = prompt if i == 0 else np.array([[7 + i]])
        if i == 3:
            plan = session.verify_plan  # what a speculative loop's first verify does
            assert isinstance(plan, CapturePlan)
            assert len(session.session.get_outputs()) == n_outputs + len(plan.outputs) > n_outputs
        got, want = session.forward(state, ids, 1), plain.forward(ref, ids, 1)
        np.testing.assert_array_equal(got, want)
    assert not list(mismatches(state.state_arrays(), ref.state_arrays()))
    assert not list(mismatches(state.kv_arrays(), ref.kv_arrays()))
    assert session.epoch == 1 and all(key[0] is session.session for key in state.bindings.binders)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_session_told_it_will_speculate_starts_on_the_plan_graph_and_loads_nothing_more(
    zoo: ModelZoo, family: str
) -> None:
    """``load(..., speculative=True)``: one session load, not a plain one and a second at the first
    verify; speculative and plain decoding on it give what they give on a lazily planned session."""
    model_dir = zoo.dir(family)
    io = ModelPackage.open(model_dir).io
    eager = DecoderSession(session_graph(model_dir / "model.onnx", io), threads=1, verify_now=True)
    lazy = session_with(zoo, family, True)
    assert eager._verify_strategy is None and isinstance(eager._verify_plan, CapturePlan)
    assert len(eager.session.get_outputs()) == len(lazy.session.get_outputs()) + len(
        eager._verify_plan.outputs
    )
    llm = zoo.llm(family)
    plain_tokens = greedy(llm, PROMPT, N).token_ids
    for session in (eager, lazy):
        oracle = NoisyOracle([*PROMPT, *plain_tokens], 0.3, session.vocab_size)
        tokens, stats = run_loop(session, oracle, PROMPT)
        assert_same_as_plain(llm.session, PROMPT, plain_tokens, tokens)
        assert stats["state_replays"] == 0
        assert 0 < stats["accepted_draft_tokens"] < stats["proposed_draft_tokens"]
    assert (eager.epoch, lazy.epoch) == (0, 1)  # the lazy one was loaded again at its first verify
    plain = replay_session(zoo, family)
    state, ref = eager.new_state(40), plain.new_state(40)
    for i in range(4):
        ids = np.array([PROMPT]) if i == 0 else np.array([[7 + i]])
        np.testing.assert_array_equal(eager.forward(state, ids, 1), plain.forward(ref, ids, 1))
    told = load(model_dir, threads=1, speculative=True)
    assert told.session.epoch == 0 and told.session._verify_strategy is None


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_commit_graph_runs_without_a_thread_pool_of_its_own(zoo: ModelZoo, family: str) -> None:
    """A second pool would spin after every commit on the cores the model's session needs."""
    model_dir = zoo.dir(family)
    session = DecoderSession(
        session_graph(model_dir / "model.onnx", ModelPackage.open(model_dir).io), threads=2
    )
    plan = session.verify_plan
    assert isinstance(plan, CapturePlan) and plan._session is not None
    assert session.session.get_session_options().intra_op_num_threads == 2
    assert plan._session.get_session_options().intra_op_num_threads == 1


def test_per_position_states_are_given_on_request_where_the_export_allows_them(zoo: ModelZoo) -> None:
    assert isinstance(session_with(zoo, "hybrid-scan", "per-position").verify_plan, PerPositionPlan)
    # fused ops can emit per-position states only through the CUDA-only state_window
    assert session_with(zoo, "hybrid-genai", "per-position").verify_plan is None
    with pytest.raises(ValueError, match="verify strategy"):
        session_with(zoo, "hybrid-genai", "sometimes")


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_models_have_no_verify_plan_and_their_graph_is_not_rewritten(
    zoo: ModelZoo, family: str
) -> None:
    session = zoo.llm(family).session
    assert session.verify_plan is None
    assert not any(
        ".capture." in o.name or o.name.endswith(".per_position") for o in session.session.get_outputs()
    )


@pytest.mark.parametrize(
    "family,verify", [*((f, True) for f in HYBRID_FAMILIES), ("hybrid-scan", "per-position")]
)
def test_speculative_greedy_through_the_plan_emits_plain_greedy_tokens_without_a_replay(
    zoo: ModelZoo, family: str, verify: bool | str
) -> None:
    llm = zoo.llm(family)
    session = llm.session if verify is True else session_with(zoo, family, verify)
    plain = greedy(llm, PROMPT, N).token_ids
    oracle = NoisyOracle([*PROMPT, *plain], p=0.3, vocab=llm.session.vocab_size)
    tokens, stats = run_loop(session, oracle, PROMPT)
    assert_same_as_plain(llm.session, PROMPT, plain, tokens)
    assert 0 < stats["accepted_draft_tokens"] < stats["proposed_draft_tokens"], "partial accepts were meant"
    assert stats["state_replays"] == 0
    oracle = NoisyOracle([*PROMPT, *plain], p=0.3, vocab=llm.session.vocab_size)
    _, replayed = run_loop(replay_session(zoo, family), oracle, PROMPT)
    assert replayed["state_replays"] > 0, "the same run without the plan must replay"
    assert stats["target_forward_passes"] == replayed["target_forward_passes"] - replayed["state_replays"]


def commit_with(session: DecoderSession, drafts: list[int], pending: int) -> DecodeState:
    """Prefill PROMPT, emit ``pending``, verify the scripted drafts, commit; the state after the commit."""
    state = session.new_state(CAPACITY)
    loop = SpeculativeLoop(
        session, state, PROMPT, SamplingParams(max_new_tokens=20), (), Scripted(drafts), K, False
    )
    tokens = loop.tokens()
    assert next(tokens)[0] == pending
    next(tokens)
    return state


@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize(
    "family,verify", [*((f, True) for f in HYBRID_FAMILIES), ("hybrid-scan", "per-position")]
)
def test_a_plan_commit_of_j_drafts_leaves_the_states_and_kv_of_the_replay(
    zoo: ModelZoo, family: str, verify: bool | str, j: int
) -> None:
    llm = zoo.llm(family)
    session = llm.session if verify is True else session_with(zoo, family, verify)
    assert session.verify_plan is not None
    plain = greedy(llm, PROMPT, K + 2).token_ids
    drafts = list(plain[1 : 1 + K])
    drafts[j] = (drafts[j] + 1) % llm.session.vocab_size
    committed = commit_with(session, drafts, plain[0])
    replayed = commit_with(replay_session(zoo, family), drafts, plain[0])
    assert committed.length == replayed.length == len(PROMPT) + 1 + j
    atol = 1e-5 if (family, j) == ("hybrid-scan", 0) else 0.0
    assert list(mismatches(committed.state_arrays(), replayed.state_arrays(), atol)) == []
    assert list(mismatches(committed.kv_arrays(), replayed.kv_arrays(), 1e-5)) == []
    # and the committed state decodes on as the replayed one does
    a = session.forward(committed, ids([plain[1 + j]]), 1)
    b = session.forward(replayed, ids([plain[1 + j]]), 1)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_state_comparison_fails_when_the_plan_commits_the_wrong_position(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    # Negative control: committing the state after all verified tokens instead of after the kept ones.
    llm = zoo.llm(family)
    plan = llm.session.verify_plan
    assert plan is not None
    commit = plan.commit
    monkeypatch.setattr(
        plan,
        "commit",
        lambda state, snap, fetched, tokens, kept: commit(state, snap, fetched, tokens, tokens),
    )
    plain = greedy(llm, PROMPT, K + 2).token_ids
    drafts = [*plain[1:2], (plain[2] + 1) % llm.session.vocab_size, *plain[3 : 1 + K]]
    committed = commit_with(llm.session, drafts, plain[0])
    replayed = commit_with(replay_session(zoo, family), drafts, plain[0])
    assert list(mismatches(committed.state_arrays(), replayed.state_arrays(), 1e-5)) != []


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_plan_that_cannot_commit_falls_back_to_a_replay(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    llm = zoo.llm(family)
    plan = llm.session.verify_plan
    monkeypatch.setattr(plan, "commit", lambda *args: False)
    plain = greedy(llm, PROMPT, N).token_ids
    tokens, stats = run_loop(llm.session, NoisyOracle([*PROMPT, *plain], 0.3, llm.session.vocab_size), PROMPT)
    assert_same_as_plain(llm.session, PROMPT, plain, tokens)
    assert stats["state_replays"] > 0


@pytest.mark.parametrize("family", ["hybrid-genai", "hybrid-mobius"])
def test_speculative_sampling_through_the_plan_draws_what_the_replay_draws(
    zoo: ModelZoo, family: str
) -> None:
    # The fused commit is bit-exact, so the same seed must give the same tokens with and without the plan.
    llm = zoo.llm(family)
    plain = greedy(llm, PROMPT, N).token_ids
    (a, a_stats), (b, b_stats) = (
        run_loop(
            s, NoisyOracle([*PROMPT, *plain], 0.3, llm.session.vocab_size), PROMPT, temperature=0.8, seed=7
        )
        for s in (llm.session, replay_session(zoo, family))
    )
    assert a == b
    assert a_stats["state_replays"] == 0 < b_stats["state_replays"]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_default_plan_returns_far_less_than_a_state_per_token(zoo: ModelZoo, family: str) -> None:
    # Per-position states would return T copies of every state on every T-token forward (prefill too);
    # the captured inputs are activations the forward computes anyway, a fraction of that.
    session = zoo.llm(family).session
    plan = session.verify_plan
    assert plan is not None
    state = session.new_state(64)
    fetched: dict = {}
    session.forward(state, ids(list(range(3, 35))), 1, fetch=plan.outputs, fetched=fetched)
    returned = sum(v.numpy().nbytes for v in fetched.values())
    per_token_states = 32 * sum(a.nbytes for a in state.state_arrays().values())
    assert set(fetched) == set(plan.outputs)
    assert returned < per_token_states / 2


def test_a_commit_graph_that_cannot_be_loaded_leaves_the_model_usable_with_replays(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxgen.runtime.state_commit as state_commit

    def broken(*args: object) -> None:
        raise RuntimeError("no such op")

    monkeypatch.setattr(state_commit, "commit_graph", broken)
    session = session_with(zoo, "hybrid-genai", True)
    plan = session.verify_plan
    assert isinstance(plan, CapturePlan) and plan.failed and plan.outputs == ()
    plain = greedy(zoo.llm("hybrid-genai"), PROMPT, N).token_ids
    tokens, stats = run_loop(session, NoisyOracle([*PROMPT, *plain], 0.3, session.vocab_size), PROMPT)
    assert_same_as_plain(session, PROMPT, plain, tokens)
    assert stats["state_replays"] > 0
