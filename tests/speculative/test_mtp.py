"""MTP speculation: the model's own head drafts, the target verifies; greedy output is plain greedy's, the
head's cache and the target's recurrent states after partial accepts are what the kept tokens give."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mtp_helpers import MTPZoo
from speculative_helpers import (
    FAMILIES,
    HYBRID_FAMILIES,
    PROMPT,
    ModelZoo,
    assert_same_as_plain,
    assert_stats_consistent,
    greedy,
    ids,
    mismatches,
)

from onnxgen import MTP, GenerationError, SamplingParams
from onnxgen.generation.speculative.mtp import MTPProposer
from onnxgen.llm import LLM
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.mtp_head import MTPHeadSession
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

N = 32
PROMPTS = (PROMPT, [9, 100, 250, 7])


def run_mtp(llm: LLM, prompt: list[int], n: int = N, **mtp: Any) -> Any:
    return llm.generate(
        prompt,
        SamplingParams(max_new_tokens=n),
        speculative=MTP(**{"num_draft_tokens": 3, "auto": False, **mtp}),
    )


@pytest.mark.parametrize(
    "family,precision", [*((f, "fp32") for f in FAMILIES), ("genai-dense", "int4"), ("hybrid-genai", "int4")]
)
def test_mtp_greedy_emits_the_plain_greedy_tokens_with_drafts_both_accepted_and_rejected(
    mtp_zoo: MTPZoo, family: str, precision: str
) -> None:
    llm = mtp_zoo.llm(family, precision)
    accepted = proposed = 0
    for prompt in PROMPTS:
        plain = greedy(llm, prompt, N)
        result = run_mtp(llm, prompt)
        assert_same_as_plain(llm.session, prompt, plain.token_ids, result.token_ids)
        assert_stats_consistent(result, hybrid=family.startswith("hybrid"))
        accepted += result.stats["accepted_draft_tokens"]
        proposed += result.stats["proposed_draft_tokens"]
    assert 0 < accepted < proposed, f"{accepted}/{proposed} drafts accepted: the test needs hits and misses"


def test_mtp_speculation_without_a_head_says_how_to_get_one(zoo: ModelZoo) -> None:
    llm = zoo.llm("genai-dense")
    with pytest.raises(GenerationError, match="export-mtp"):  # when the stream is asked for, not later
        llm.stream(PROMPT, SamplingParams(max_new_tokens=4), speculative=MTP())


def test_a_session_that_outputs_the_hidden_state_gives_the_plain_sessions_logits_bit_for_bit(
    mtp_zoo: MTPZoo,
) -> None:
    llm = mtp_zoo.llm("hybrid-genai", "int4")
    assert llm.session.hidden_state == "hidden_states"
    plain = DecoderSession(session_graph(llm.package.model_path, llm.io), threads=1)
    assert plain.hidden_state is None
    tokens = [*PROMPT, 3, 99, 250]
    a, b = llm.session.new_state(32), plain.new_state(32)
    rows = [(llm.session.forward(a, ids(PROMPT), 1), plain.forward(b, ids(PROMPT), 1))]
    rows += [(llm.session.step(a, t).copy(), plain.step(b, t).copy()) for t in tokens[len(PROMPT) :]]
    rows += [(llm.session.forward(a, ids([5, 6, 7])), plain.forward(b, ids([5, 6, 7])))]
    for ours, theirs in rows:
        assert np.array_equal(ours, theirs)


# -- auto ---------------------------------------------------------------------------------------------------


LONG = 96  # with back-off (1, 2, 4, 8, 16 plain steps after each missed verify): 8 verifies when drafting on


def test_auto_turns_a_random_head_off_and_keeps_the_plain_greedy_tokens(mtp_zoo: MTPZoo) -> None:
    llm = mtp_zoo.llm("hybrid-genai", head="random")
    plain = greedy(llm, PROMPT, LONG)
    result = llm.generate(PROMPT, SamplingParams(max_new_tokens=LONG), speculative=MTP(num_draft_tokens=1))
    assert result.token_ids == plain.token_ids
    stats = result.stats
    assert stats["speculation"].startswith("off after"), stats
    assert stats["predicted_speedup"] < 1.0
    assert stats["proposed_draft_tokens"] <= 5, "drafting went on after auto turned it off"


def test_without_auto_a_random_head_drafts_throughout(mtp_zoo: MTPZoo) -> None:
    llm = mtp_zoo.llm("hybrid-genai", head="random")
    result = run_mtp(llm, PROMPT, LONG, num_draft_tokens=1, adaptive=False)
    assert "speculation" not in result.stats
    assert result.stats["proposed_draft_tokens"] >= 7


# -- the head's cache and the target's states after partial accepts ---------------------------------------


def record_head(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[MTPProposer], list[tuple[int, np.ndarray, np.ndarray]]]:
    """The proposers made, and the catch-up forward of every proposal (the first head forward after it
    starts: the entries built from the target's hidden states) as (start, tokens, hidden)."""
    proposers: list[MTPProposer] = []
    catch_ups: list[tuple[int, np.ndarray, np.ndarray]] = []
    propose, forward = MTPProposer.propose, MTPHeadSession.forward

    def recorded_propose(self: MTPProposer, history: np.ndarray, k: int) -> Any:
        if not proposers or proposers[-1] is not self:
            proposers.append(self)
        catch_ups.append((-1, history, history))  # filled in by the forward that follows
        return propose(self, history, k)

    def recorded_forward(
        self: MTPHeadSession, state: DecodeState, tokens: np.ndarray, hidden: np.ndarray
    ) -> Any:
        if catch_ups and catch_ups[-1][0] == -1:
            catch_ups[-1] = (state.length, tokens.copy(), hidden.copy())
        return forward(self, state, tokens, hidden)

    monkeypatch.setattr(MTPProposer, "propose", recorded_propose)
    monkeypatch.setattr(MTPHeadSession, "forward", recorded_forward)
    return proposers, catch_ups


def head_replay(
    proposer: MTPProposer, catch_ups: list[tuple[int, np.ndarray, np.ndarray]]
) -> dict[str, np.ndarray]:
    """A fresh head cache fed the catch-up entries (those built from the target's hidden states) only,
    one forward each as the proposer ran them."""
    state = proposer.head.new_state(proposer.state.capacity)
    for start, tokens, hidden in catch_ups:
        assert start == state.length, "a catch-up did not start where the previous one ended"
        proposer.head.forward(state, tokens, hidden)
    return state.kv_arrays()


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai", "hybrid-scan"])
def test_the_heads_cache_after_partial_accepts_is_bit_identical_to_a_replay_of_the_kept_entries(
    mtp_zoo: MTPZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    llm = mtp_zoo.llm(family)
    proposers, catch_ups = record_head(monkeypatch)
    result = run_mtp(llm, PROMPT)
    stats = result.stats
    assert 0 < stats["accepted_draft_tokens"] < stats["proposed_draft_tokens"]
    (proposer,) = proposers
    catch_ups = [c for c in catch_ups if c[0] >= 0]
    tokens = [*PROMPT, *result.token_ids]
    # the entries are (token after i, the target's hidden state at i): the tokens are the output's, the
    # hidden states the target's at those positions (to rounding: verifies and plain steps group the
    # tokens differently from the single forward here)
    assert np.concatenate([t[0] for _, t, _ in catch_ups]).tolist() == tokens[1 : proposer.fed + 1]
    state = llm.session.new_state(len(tokens))
    fetched: dict[str, Any] = {}
    hidden_name = llm.session.hidden_state
    llm.session.forward(state, ids(tokens[: proposer.fed]), fetch=(hidden_name,), fetched=fetched)
    handed = np.concatenate([h[0] for _, _, h in catch_ups])
    np.testing.assert_allclose(handed, fetched[hidden_name].numpy()[0], atol=1e-4)
    kept = {name: kv[:, :, : proposer.fed] for name, kv in proposer.state.kv_arrays().items()}
    assert list(mismatches(kept, head_replay(proposer, catch_ups))) == []
    # negative control: one hidden state off by a little, and the replay no longer matches
    start, t, h = catch_ups[1]
    off = h.copy()
    off[0, 0] += 1e-3
    catch_ups[1] = (start, t, off)
    assert list(mismatches(kept, head_replay(proposer, catch_ups))) != []


def final_state(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[DecodeState]:
    """Collects the decode states that requests hand back when they finish."""
    states: list[DecodeState] = []
    give_back = llm.generator.give_back

    def kept(state: DecodeState) -> None:
        states.append(state)
        give_back(state)

    monkeypatch.setattr(llm.generator, "give_back", kept)
    return states


def record_target_forwards(monkeypatch: pytest.MonkeyPatch, session: DecoderSession) -> list[tuple[int, int]]:
    """(start, tokens) of every forward run on ``session`` over a state's own cursor."""
    calls: list[tuple[int, int]] = []
    forward, step = session.forward, session.step

    def recorded_forward(state: Any, batch: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        calls.append((state.length, batch.shape[1]))
        return forward(state, batch, *args, **kwargs)

    def recorded_step(state: Any, token: int, *args: Any, **kwargs: Any) -> np.ndarray:
        calls.append((state.length, 1))
        return step(state, token, *args, **kwargs)

    monkeypatch.setattr(session, "forward", recorded_forward)
    monkeypatch.setattr(session, "step", recorded_step)
    return calls


def committed_groups(calls: list[tuple[int, int]], tokens: list[int]) -> list[list[int]]:
    """The token groups that stayed: a forward followed by one from the same start was undone (a verify
    whose snapshot was restored for a replay of the kept tokens)."""
    kept = [c for i, c in enumerate(calls) if i + 1 == len(calls) or calls[i + 1][0] != c[0]]
    return [tokens[s : s + n] for s, n in kept]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_targets_states_after_partial_accepts_are_bit_identical_to_a_replay_of_the_committed_groups(
    mtp_zoo: MTPZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    llm = mtp_zoo.llm(family)
    monkeypatch.setattr(llm.session, "verify_plan", None)  # commit by restore + replay of the kept tokens
    calls = record_target_forwards(monkeypatch, llm.session)
    states = final_state(monkeypatch, llm)
    result = run_mtp(llm, PROMPT)
    stats = result.stats
    assert 0 < stats["accepted_draft_tokens"] < stats["proposed_draft_tokens"] and stats["state_replays"] > 0
    (final,) = states
    tokens = [*PROMPT, *result.token_ids]
    groups = committed_groups(calls, tokens)
    assert sum(map(len, groups)) == final.length
    fresh = llm.session.new_state(final.capacity)
    for group in groups:
        llm.session.forward(fresh, ids(group))
    assert list(mismatches(final.state_arrays(), fresh.state_arrays())) == []
    assert list(mismatches(final.kv_arrays(), fresh.kv_arrays())) == []
    # negative control: the same comparison sees a state fed one token otherwise
    other = llm.session.new_state(final.capacity)
    for i, group in enumerate(groups):
        llm.session.forward(other, ids([(group[0] + 1) % 320, *group[1:]] if i == 1 else group))
    assert list(mismatches(final.state_arrays(), other.state_arrays())) != []


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_with_the_verify_plan_the_targets_states_agree_with_a_plain_run_to_rounding(
    mtp_zoo: MTPZoo, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    llm = mtp_zoo.llm(family)
    states = final_state(monkeypatch, llm)
    result = run_mtp(llm, PROMPT)
    assert result.stats["state_replays"] == 0 or llm.session.verify_plan is None
    (final,) = states
    tokens = [*PROMPT, *result.token_ids][: final.length]
    fresh = llm.session.new_state(final.capacity)
    llm.session.forward(fresh, ids(tokens[: len(PROMPT)]))
    for t in tokens[len(PROMPT) :]:
        llm.session.forward(fresh, ids([t]))
    for ours, theirs in (
        (final.state_arrays(), fresh.state_arrays()),
        (final.kv_arrays(), fresh.kv_arrays()),
    ):
        assert list(mismatches(ours, theirs, atol=1e-5)) == []


def test_the_engine_drafts_with_an_int4_lm_head_and_a_head_loaded_alone_keeps_the_exact_one(
    mtp_zoo: MTPZoo,
) -> None:
    """The engine's head runs its lm_head as int4 (cheaper drafts; the verified output is plain greedy's,
    above); its draft logits stay close to the exact head's, which a head loaded alone still gives."""
    import onnx

    from onnxgen.graph.logits_to_keep import find_lm_head

    llm = mtp_zoo.llm("hybrid-genai")
    engine = llm.mtp_head()
    exact = MTPHeadSession(engine.head, threads=1)

    def lm_head_op(head: MTPHeadSession) -> str:
        prepared = head.session.prepared.graph_path
        graph = onnx.load(str(prepared or head.head.path), load_external_data=False).graph
        node, why = find_lm_head(graph, head.head.io.logits)
        assert node is not None, why
        return node.op_type

    assert (lm_head_op(engine), lm_head_op(exact)) == ("MatMulNBits", "MatMul")
    hidden = np.random.default_rng(0).standard_normal((1, 4, engine.hidden_size)).astype(np.float32)
    tokens = np.array([[5, 17, 42, 99]], dtype=np.int64)
    got, _ = engine.forward(engine.new_state(8), tokens, hidden)
    want, _ = exact.forward(exact.new_state(8), tokens, hidden)
    assert not np.array_equal(got, want)
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error < 0.2, f"int4 draft logits {error:.0%} off the exact ones (for other inputs: ~150%)"
