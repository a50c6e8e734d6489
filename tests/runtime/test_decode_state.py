"""DecodeState through DecoderSession.forward: cached steps, KV modes, snapshots, rewind, capacity, reset, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import (
    DENSE_FAMILIES,
    HYBRID,
    HYBRID_FAMILIES,
    PROMPT,
    ids,
    open_session,
    prefilled,
    teacher_forced,
)

from onnxgen.errors import GenerationError
from onnxgen.runtime import state as state_module
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

FAMILIES = DENSE_FAMILIES + HYBRID_FAMILIES
SHARED_FAMILIES = ("genai-dense", "hybrid-genai")  # GroupQueryAttention: past_present_share_buffer
CONTINUATION = [40, 7, 300, 41, 2, 99]
MORE = [3, 4, 5]


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_single_token_steps_end_on_the_logits_of_one_forward_over_the_whole_sequence(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    stepped = teacher_forced(session, session.new_state(64), PROMPT, CONTINUATION)
    whole = session.forward(session.new_state(64), ids(PROMPT + CONTINUATION))[0]
    assert whole.shape[0] == len(PROMPT) + len(CONTINUATION)
    np.testing.assert_allclose(stepped[-1], whole[-1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(stepped, whole[len(PROMPT) - 1 :], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_a_shared_kv_buffer_and_a_growing_kv_cache_give_the_same_logits_and_cache(
    family_dirs: dict[str, Path], sessions: dict[str, DecoderSession], family: str
) -> None:
    shared = sessions[family]
    assert shared.io.past_present_share_buffer
    growing = open_session(family_dirs[family], shared_kv=False)
    s_state, g_state = shared.new_state(32), growing.new_state(32)
    assert s_state.shared_kv and not g_state.shared_kv
    s_logits = teacher_forced(shared, s_state, PROMPT, CONTINUATION)
    g_logits = teacher_forced(growing, g_state, PROMPT, CONTINUATION)
    np.testing.assert_allclose(s_logits, g_logits, atol=1e-5, rtol=0)
    s_kv, g_kv = s_state.kv_arrays(), g_state.kv_arrays()
    assert s_kv.keys() == g_kv.keys() and s_kv
    for name in s_kv:
        assert s_kv[name].shape[2] == len(PROMPT) + len(CONTINUATION)
        np.testing.assert_allclose(s_kv[name], g_kv[name], atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_restoring_a_snapshot_and_rerunning_the_tokens_reproduces_logits_and_buffers_bit_for_bit(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = prefilled(session)
    before = (state.state_arrays(), state.kv_arrays())
    snap = state.snapshot()
    first = session.forward(state, ids(MORE))
    after = (state.state_arrays(), state.kv_arrays())
    state.restore(snap)
    assert state.length == len(PROMPT)
    assert_same_arrays(state.state_arrays(), before[0])
    assert_same_arrays(state.kv_arrays(), before[1])
    again = session.forward(state, ids(MORE))
    np.testing.assert_array_equal(again, first)
    assert_same_arrays(state.state_arrays(), after[0])
    assert_same_arrays(state.kv_arrays(), after[1])
    state.release(snap)


@pytest.mark.parametrize("family", FAMILIES)
def test_restoring_after_several_single_token_steps_goes_back_to_the_snapshot(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = prefilled(session)
    snap = state.snapshot()
    first = [session.forward(state, ids(t)) for t in CONTINUATION]
    state.restore(snap)
    # A different branch first, then back again: the snapshot is unaffected by either.
    for t in MORE:
        session.forward(state, ids(t))
    state.restore(snap)
    again = [session.forward(state, ids(t)) for t in CONTINUATION]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(b, a)
    assert state.length == len(PROMPT) + len(CONTINUATION)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Shapes of every recurrent-state buffer allocated while the test runs (logits buffers left out)."""
    made: list[tuple[int, ...]] = []
    zeros = state_module.HostBuffer.zeros.__func__  # type: ignore[attr-defined]

    def counting(cls: type, shape: tuple[int, ...], dtype: np.dtype) -> object:
        if shape[-1] != HYBRID.vocab_size:
            made.append(shape)
        return zeros(cls, shape, dtype)

    monkeypatch.setattr(state_module.HostBuffer, "zeros", classmethod(counting))
    return made


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_released_snapshots_let_state_buffers_be_reused_over_many_cycles(
    sessions: dict[str, DecoderSession], family: str, allocations: list[tuple[int, ...]]
) -> None:
    session = sessions[family]
    state = prefilled(session, 128)
    for _ in range(3):  # warm up: the spares a snapshot cycle needs
        snap = state.snapshot()
        session.forward(state, ids(7))
        state.restore(snap)
        state.release(snap)
    warm = len(allocations)
    for i in range(40):
        snap = state.snapshot()
        session.forward(state, ids(MORE))
        if i % 2:
            state.restore(snap)
        state.release(snap)
    assert len(allocations) == warm


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_unreleased_snapshots_keep_their_buffers_pinned(
    sessions: dict[str, DecoderSession], family: str, allocations: list[tuple[int, ...]]
) -> None:
    # The converse of the test above: without release() every snapshot keeps its buffers, so the
    # allocation count there staying flat is down to release().
    session = sessions[family]
    state = prefilled(session)
    base = len(allocations)
    snaps = []
    for _ in range(5):
        snaps.append(state.snapshot())
        session.forward(state, ids(7))
    assert len(allocations) > base
    state.restore(snaps[0])
    np.testing.assert_array_equal(session.forward(state, ids(7)), session.forward(prefilled(session), ids(7)))


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_rewind_truncates_the_kv_cache_and_rerunning_the_dropped_tokens_reproduces_the_logits(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = prefilled(session)
    kept = state.kv_arrays()
    first = [session.forward(state, ids(t)) for t in CONTINUATION]
    state.rewind(len(PROMPT))
    assert state.length == len(PROMPT)
    for name, kv in state.kv_arrays().items():
        assert kv.shape[2] == len(PROMPT)
        np.testing.assert_array_equal(kv, kept[name])
    again = [session.forward(state, ids(t)) for t in CONTINUATION]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_rewind_outside_the_sequence_is_refused(sessions: dict[str, DecoderSession], family: str) -> None:
    state = prefilled(sessions[family])
    for bad in (-1, len(PROMPT) + 1):
        with pytest.raises(ValueError, match=rf"\[0, {len(PROMPT)}\].*{bad}"):
            state.rewind(bad)
    assert state.length == len(PROMPT)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_rewind_on_a_hybrid_raises_and_leaves_the_state_as_it_was(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = prefilled(session)
    before = state.state_arrays()
    with pytest.raises(GenerationError, match=r"recurrent state cannot be rewound.*snapshot"):
        state.rewind(len(PROMPT) - 2)
    assert state.length == len(PROMPT)
    assert_same_arrays(state.state_arrays(), before)
    np.testing.assert_array_equal(session.forward(state, ids(7)), session.forward(prefilled(session), ids(7)))


@pytest.mark.parametrize("family", FAMILIES)
def test_running_past_the_capacity_raises_a_clear_error_and_keeps_the_state_usable(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    capacity = len(PROMPT) + 2
    state = prefilled(session, capacity)
    with pytest.raises(GenerationError, match=rf"{len(PROMPT) + 3} tokens.*holds {capacity}"):
        session.forward(state, ids(MORE))
    assert state.length == len(PROMPT)
    np.testing.assert_array_equal(
        session.forward(state, ids(MORE[:2])), session.forward(prefilled(session), ids(MORE[:2]))
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_reset_gives_zero_states_length_zero_and_a_fresh_start(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = prefilled(session)
    snap = state.snapshot()  # a pinned buffer must not stop reset from zeroing the states
    session.forward(state, ids(MORE))
    state.restore(snap)
    state.reset()
    assert state.length == 0
    assert all(not arr.any() for arr in state.state_arrays().values())
    assert all(kv.shape[2] == 0 for kv in state.kv_arrays().values())
    fresh = session.forward(session.new_state(64), ids(PROMPT))
    np.testing.assert_array_equal(session.forward(state, ids(PROMPT)), fresh)
    state.release(snap)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_reset_state_reads_as_zeros_whatever_comes_first(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    """reset() does not write the states: the first forward reads zeros (one token or many), a snapshot
    taken before it holds zeros, and the buffers' old, nonzero values never leak into a forward."""
    session = sessions[family]
    for first in ([PROMPT[0]], PROMPT):
        want = session.forward(session.new_state(64), ids(first))
        state = prefilled(session)
        assert any(arr.any() for arr in state.state_arrays().values())  # old values that could leak
        state.reset()
        np.testing.assert_array_equal(session.forward(state, ids(first)), want)  # zeros read, not written
        state = prefilled(session)
        state.reset()
        snap = state.snapshot()  # of a reset state: its zeros
        session.forward(state, ids(MORE))
        state.restore(snap)
        np.testing.assert_array_equal(session.forward(state, ids(first)), want)
        state.release(snap)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reset_state_decodes_like_a_fresh_one_and_shared_kv_states_keep_their_bindings(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]

    def run(state: DecodeState) -> list[np.ndarray]:
        out = [session.forward(state, ids(PROMPT))]
        snap = state.snapshot()  # pinned across the reset below: reset must not hand it out again
        out += [session.forward(state, ids([t])) for t in CONTINUATION[:3]]
        out.append(session.forward(state, ids(MORE)))  # a multi-token forward, as a verify is
        state.restore(snap)
        out += [session.forward(state, ids([t])) for t in CONTINUATION[3:]]
        return out

    want = run(session.new_state(64))
    state = session.new_state(64)
    run(state)
    binders = dict(state.bindings.binders)
    state.reset()
    if family in SHARED_FAMILIES:  # bound buffers are the state's own: kept for the next run
        assert state.bindings.binders == binders and binders
    else:  # growing KV: bindings would keep the last run's pasts alive
        assert not state.bindings.binders
    for _ in range(2):
        for got, expected in zip(run(state), want, strict=True):
            np.testing.assert_array_equal(got, expected)
        state.reset()


def test_hybrid_fixtures_carry_nonzero_recurrent_states(sessions: dict[str, DecoderSession]) -> None:
    # The zero-state and bit-identity checks above would be vacuous on states that stay zero.
    for family in HYBRID_FAMILIES:
        arrays = prefilled(sessions[family]).state_arrays()
        assert len(arrays) == 6 and all(arr.any() for arr in arrays.values()), family


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["refused", "fails in onnxruntime"])
def test_a_failed_forward_leaves_the_state_usable(
    sessions: dict[str, DecoderSession], family: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = sessions[family]
    state = prefilled(session)
    before = (state.state_arrays(), state.kv_arrays())
    if how == "refused":  # an id outside the vocabulary is refused before anything runs
        with pytest.raises(
            GenerationError, match=f"position {len(PROMPT)} are outside the model's vocabulary"
        ):
            session.forward(state, ids([7, session.vocab_size + 5]))
    else:  # onnxruntime ran (writing the spare state buffers and the shared KV) and then failed
        run = session.session.run_with_iobinding

        def fail_after_running(*args: object) -> None:
            run(*args)  # type: ignore[arg-type]
            raise RuntimeError("simulated failure after the kernels ran")

        monkeypatch.setattr(session.session, "run_with_iobinding", fail_after_running)
        with pytest.raises(GenerationError, match=f"position {len(PROMPT)} failed"):
            session.forward(state, ids([7, 8]))
        monkeypatch.undo()
    assert state.length == len(PROMPT)
    assert_same_arrays(state.state_arrays(), before[0])
    assert_same_arrays(state.kv_arrays(), before[1])
    np.testing.assert_array_equal(
        session.forward(state, ids(MORE)), session.forward(prefilled(session), ids(MORE))
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_of_another_batch_size_are_refused(sessions: dict[str, DecoderSession], family: str) -> None:
    state = sessions[family].new_state(16)
    with pytest.raises(GenerationError, match=r"batch 2.*made for 1"):
        sessions[family].forward(state, np.zeros((2, 3), dtype=np.int64))
    assert state.length == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_restoring_a_snapshot_whose_cache_was_overwritten_never_gives_silently_wrong_logits(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = prefilled(session)
    early = state.snapshot()
    session.forward(state, ids([7, 7]))
    late = state.snapshot()
    expected = session.forward(state, ids(9))
    state.restore(early)
    session.forward(state, ids([50, 60, 70]))  # rewrites the positions `late` depends on
    try:
        state.restore(late)
    except GenerationError as e:
        assert state.shared_kv, "only a shared KV buffer can lose a snapshot's positions"
        assert "overwritten" in str(e)
        return
    np.testing.assert_array_equal(session.forward(state, ids(9)), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_later_snapshot_can_be_restored_again_while_nothing_overwrote_it(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    state = prefilled(session)
    early = state.snapshot()
    session.forward(state, ids([7, 7]))
    late = state.snapshot()
    expected = session.forward(state, ids(9))
    state.restore(early)
    state.restore(late)
    np.testing.assert_array_equal(session.forward(state, ids(9)), expected)
    state.restore(early)
    session.forward(state, ids(9))  # writes only position len(PROMPT): `late` needs it
    if state.shared_kv:
        with pytest.raises(GenerationError, match=f"snapshot at length {len(PROMPT) + 2}.*overwritten"):
            state.restore(late)
        state.restore(early)  # an untouched snapshot still restores
        assert state.length == len(PROMPT)


def _scripted_run(
    session: DecoderSession,
) -> tuple[list[np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """Steady single-token steps interrupted by everything that moves buffers; returns every forward's
    logits, the final states and KV, and how many steps ran on the steady cycle."""
    cycled = 0
    prepare = DecodeState.prepare

    def counting(self: DecodeState, new_tokens: int) -> state_module.StepIO:
        nonlocal cycled
        step = prepare(self, new_tokens)
        cycled += step.cycled
        return step

    out: list[np.ndarray] = []
    state = session.new_state(64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DecodeState, "prepare", counting)
        out.append(session.forward(state, ids(PROMPT), 1))
        out += [session.forward(state, ids(t)) for t in CONTINUATION]
        snap = state.snapshot()  # pins the current buffers: steps must not write them
        out += [session.forward(state, ids(t)) for t in MORE]
        state.restore(snap)
        out += [session.forward(state, ids(t)) for t in MORE[::-1]]
        state.release(snap)
        out += [session.forward(state, ids(t)) for t in CONTINUATION]
        out.append(session.forward(state, ids([5, 6, 7])))  # a longer forward (all its logits kept)
        out += [session.forward(state, ids(t)) for t in MORE]
        with pytest.raises(GenerationError):
            session.forward(state, ids([session.vocab_size + 5]))
        out += [session.forward(state, ids(t)) for t in CONTINUATION]
    return out, state.state_arrays(), state.kv_arrays(), cycled


@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_steady_single_token_steps_match_steps_that_rebuild_their_bindings(
    sessions: dict[str, DecoderSession], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steady cycle (two fixed StepIO, buffers swapped) against the path that takes spares every
    step, through snapshots, restores, a longer forward and a failed step: bit for bit."""
    session = sessions[family]
    fast, fast_states, fast_kv, cycled = _scripted_run(session)
    assert cycled >= 10  # the cycle carried most single-token steps
    monkeypatch.setattr(DecodeState, "_start_cycle", lambda self: None)
    slow, slow_states, slow_kv, none = _scripted_run(session)
    assert none == 0
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a, b)
    assert_same_arrays(fast_states, slow_states)
    assert_same_arrays(fast_kv, slow_kv)
