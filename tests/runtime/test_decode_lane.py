"""DecoderSession.step: steady decode steps through a prepared lane, against ordinary forwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import PROMPT, ids, open_session

from onnxgen.errors import GenerationError
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.binding import LengthMask, StepLane
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

SHARED_FAMILIES = ("genai-dense", "hybrid-genai")  # GroupQueryAttention: the steady cycle runs
STEPS = [40, 7, 300, 41, 2, 99, 3, 4, 5, 17]


def _script(session: DecoderSession, single: bool) -> tuple[list[np.ndarray], dict[str, np.ndarray], int]:
    """Single-token steps (through ``step`` when ``single``, else ``forward``) interrupted by everything
    that moves buffers or rebinds a lane's binder; returns each step's logits row, the final states and
    KV, and how many steps ran on a lane (on a lane that keeps a capacity-long mask bound, counted
    negative)."""
    lane_runs = 0
    make = DecoderSession._lane

    def counting_lane(self: DecoderSession, *args: object) -> StepLane | None:
        lane = make(self, *args)  # type: ignore[arg-type]
        if lane is None:
            return None
        run = lane.run
        sign = -1 if lane.mask is not None else 1

        def counted(binding: object, options: object) -> None:
            nonlocal lane_runs
            lane_runs += sign
            run(binding, options)  # type: ignore[arg-type]

        lane.run = counted
        return lane

    def one(state: DecodeState, token: int) -> np.ndarray:
        if single:
            return session.step(state, token).copy()
        return session.forward(state, ids(token))[0, -1]

    out: list[np.ndarray] = []
    state = session.new_state(128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DecoderSession, "_lane", counting_lane)
        out.append(session.forward(state, ids(PROMPT), 1)[0, -1])
        out += [one(state, t) for t in STEPS]
        snap = state.snapshot()  # ends the cycle: lanes must not run on the pinned buffers
        out += [one(state, t) for t in STEPS[:3]]
        state.restore(snap)
        out += [one(state, t) for t in STEPS[3:6]]
        state.release(snap)
        out += [one(state, t) for t in STEPS]
        out.append(session.forward(state, ids([5, 6]))[0, -1])  # rebinds the token input of a lane's binder
        out += [one(state, t) for t in STEPS]
        out.append(session.forward(state, ids([8, 9, 10]), 2)[0, -1])  # logits-to-keep 2 in the shared buffer
        out += [one(state, t) for t in STEPS]
        with pytest.raises(GenerationError, match="outside the model's vocabulary"):
            one(state, session.vocab_size + 5)  # refused before running; nothing is committed
        out += [one(state, t) for t in STEPS]
        state.reset()
        out.append(session.forward(state, ids(PROMPT), 1)[0, -1])
        out += [one(state, t) for t in STEPS]
    return out, {**state.state_arrays(), **state.kv_arrays()}, lane_runs


@pytest.mark.parametrize("length_mask", [True, False], ids=["capacity-mask", "mask-per-step"])
@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_lane_steps_equal_ordinary_forwards_bit_for_bit(
    sessions: dict[str, DecoderSession], family: str, length_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = sessions[family]
    assert session.length_mask  # both families give GroupQueryAttention its lengths from the mask
    monkeypatch.setattr(session, "length_mask", length_mask)
    stepped, stepped_state, lane_runs = _script(session, single=True)
    # most steady steps ran on a lane, of the kind asked for
    assert (-lane_runs if length_mask else lane_runs) >= 40
    forwarded, forwarded_state, none = _script(session, single=False)
    assert none == 0  # forward never takes a lane
    assert len(stepped) == len(forwarded)
    for i, (a, b) in enumerate(zip(stepped, forwarded, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
    assert stepped_state.keys() == forwarded_state.keys()
    for name in stepped_state:
        np.testing.assert_array_equal(stepped_state[name], forwarded_state[name], err_msg=name)


@pytest.mark.parametrize("length_mask", [True, False], ids=["capacity-mask", "mask-per-step"])
@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_a_lane_that_does_not_bind_the_grown_mask_is_caught(
    sessions: dict[str, DecoderSession], family: str, length_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: a lane that leaves the attention mask of its last run as it was (binds no new
    mask, or does not write the new position into the capacity-long one) diverges from forward (the
    mask tells attention how many positions the shared KV buffer holds)."""
    session = sessions[family]
    monkeypatch.setattr(session, "length_mask", length_mask)
    make = DecoderSession._lane

    def stale_mask(self: DecoderSession, *args: object) -> StepLane | None:
        lane = make(self, *args)  # type: ignore[arg-type]
        if lane is not None:
            lane.bind_input = lambda name, value: None
            if lane.mask is not None:
                lane.mask.row = lane.mask.row.copy()  # writes no longer reach the bound buffer
        return lane

    monkeypatch.setattr(DecoderSession, "_lane", stale_mask)
    state, reference = session.new_state(32), session.new_state(32)
    session.forward(state, ids(PROMPT), 1)
    session.forward(reference, ids(PROMPT), 1)
    differs = False
    for t in STEPS:
        got = session.step(state, t).copy()
        differs |= not np.array_equal(got, session.forward(reference, ids(t))[0, -1])
    assert differs


def _rewinding(session: DecoderSession, single: bool) -> list[np.ndarray]:
    """Steady steps on a dense shared-KV state cut back by rewinds (a speculative commit's) of 1-6 tokens,
    so that lanes still valid after a rewind step at an earlier position."""
    state = session.new_state(96)
    out = [session.forward(state, ids(PROMPT), 1)[0, -1]]
    for back in (3, 1, 6, 2):
        for t in STEPS:
            out.append(session.step(state, t).copy() if single else session.forward(state, ids(t))[0, -1])
        state.rewind(state.length - back)
    out += [session.step(state, t).copy() if single else session.forward(state, ids(t))[0, -1] for t in STEPS]
    return out


def test_capacity_mask_lanes_follow_rewinds(
    sessions: dict[str, DecoderSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    session = sessions["genai-dense"]
    assert session.length_mask
    forwarded = _rewinding(session, single=False)
    for a, b in zip(_rewinding(session, single=True), forwarded, strict=True):
        np.testing.assert_array_equal(a, b)

    # negative control: a mask that is not cut back with the KV cache lets attention read stale positions
    def fill_without_cut(self: LengthMask, length: int) -> None:
        self.row[:length] = 1
        self.filled = length

    monkeypatch.setattr(LengthMask, "fill", fill_without_cut)
    stale = _rewinding(session, single=True)
    assert any(not np.array_equal(a, b) for a, b in zip(stale, forwarded, strict=True))


def test_lanes_follow_the_session_onto_its_verify_plan_graph(family_dirs: dict[str, Path]) -> None:
    """The first speculative verify moves the session onto another onnxruntime session: lanes of the old
    one are not run again, and steps on the new one match forwards there."""
    session, reference = open_session(family_dirs["hybrid-genai"]), open_session(family_dirs["hybrid-genai"])
    state, ref_state = session.new_state(64), reference.new_state(64)
    for s, st in ((session, state), (reference, ref_state)):
        s.forward(st, ids(PROMPT), 1)
    for t in STEPS:
        np.testing.assert_array_equal(session.step(state, t), reference.forward(ref_state, ids(t))[0, -1])
    old = session.session
    assert session.verify_plan is not None and reference.verify_plan is not None
    assert session.session is not old
    for t in STEPS:
        np.testing.assert_array_equal(session.step(state, t), reference.forward(ref_state, ids(t))[0, -1])
    lanes = [lane for lane in state.bindings.lanes if lane is not None]
    assert lanes and all(lane.session is session.session for lane in lanes)  # type: ignore[attr-defined]


def _session(model_dir: Path, inplace: bool) -> DecoderSession:
    return DecoderSession(
        session_graph(model_dir / "model.onnx", ModelPackage.open(model_dir).io), threads=1, inplace=inplace
    )


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_states_looked_at_mid_cycle_are_the_ones_the_last_step_wrote(
    family_dirs: dict[str, Path], steps: int
) -> None:
    """Steady steps count the swaps of each double-buffered state's two buffers instead of making them:
    after an odd or even number of them, ``state_arrays`` and a snapshot see what the last step wrote.
    The reference holds a snapshot throughout, so its steps take spares and never cycle."""
    session = _session(family_dirs["hybrid-genai"], False)  # every state double-buffered
    state, ref = session.new_state(64), session.new_state(64)
    session.forward(state, ids(PROMPT), 1)
    session.forward(ref, ids(PROMPT), 1)
    held = ref.snapshot()
    tokens = STEPS[:steps]
    for t in tokens:
        np.testing.assert_array_equal(session.step(state, t), session.step(ref, t))
    assert state._cycle[state.steps & 1] is not None and ref._cycle == [None, None]
    got, want = state.state_arrays(), ref.state_arrays()
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    snap = state.snapshot()
    after = [session.step(state, t).copy() for t in (3, 4, 5)]
    state.restore(snap)
    assert all(np.array_equal(a, session.step(state, t)) for a, t in zip(after, (3, 4, 5), strict=True))
    state.release(snap)
    ref.release(held)


def test_states_updated_in_place_equal_double_buffered_states(family_dirs: dict[str, Path]) -> None:
    """The fused hybrid's LinearAttention states are bound in place in the steady cycle; everything the
    script does (snapshots, restores, longer forwards, a refused step, reset) gives the same logits and
    states bit for bit as the session that double-buffers them."""
    inplace, buffered = (
        _session(family_dirs["hybrid-genai"], True),
        _session(family_dirs["hybrid-genai"], False),
    )
    assert len(inplace.inplace_states) == 3 and not buffered.inplace_states
    got, got_state, _ = _script(inplace, single=True)
    want, want_state, _ = _script(buffered, single=True)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
    for name in want_state:
        np.testing.assert_array_equal(got_state[name], want_state[name], err_msg=name)


def test_the_first_step_after_a_released_snapshot_already_runs_in_place(family_dirs: dict[str, Path]) -> None:
    """A verify (snapshot, longer forward, release) ends the cycle; the next single-token step starts it
    again at once, so it updates the LinearAttention states in place (their buffers stay the same) while
    the other states move to their spares, and gives the double-buffered session's logits."""
    session, buffered = (
        _session(family_dirs["hybrid-genai"], True),
        _session(family_dirs["hybrid-genai"], False),
    )
    state, ref = session.new_state(64), buffered.new_state(64)
    for s, st in ((session, state), (buffered, ref)):
        s.forward(st, ids(PROMPT), 1)
        snap = st.snapshot()
        s.forward(st, np.array([[4, 8, 15]]), 1)
        st.release(snap)
    before = {slot.pair.input: slot.current for slot in state._slots}
    np.testing.assert_array_equal(session.step(state, 16), buffered.step(ref, 16))
    state._sync_cycle()  # a running cycle counts its buffer swaps; this makes them
    moved = {
        name
        for name, buf in before.items()
        if next(s for s in state._slots if s.pair.input == name).current is not buf
    }
    assert moved and moved.isdisjoint(session.inplace_states)
    assert moved | session.inplace_states == set(before)


def test_a_snapshot_taken_inside_an_in_place_cycle_would_be_overwritten(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: snapshots end the cycle because in-place steps write the current buffers; a
    snapshot that left the cycle running restores states that later steps overwrote."""
    session = _session(family_dirs["hybrid-genai"], True)

    def restore_wrong(script_session: DecoderSession) -> bool:
        state = script_session.new_state(64)
        script_session.forward(state, ids(PROMPT), 1)
        for t in STEPS[:4]:
            script_session.step(state, t)
        snap = state.snapshot()
        expected = script_session.step(state, 9).copy()
        for t in STEPS[4:8]:
            script_session.step(state, t)
        state.restore(snap)
        return not np.array_equal(script_session.step(state, 9), expected)

    assert not restore_wrong(session)
    monkeypatch.setattr(DecodeState, "snapshot", _snapshot_keeping_the_cycle())
    assert restore_wrong(_session(family_dirs["hybrid-genai"], True))


def _snapshot_keeping_the_cycle():  # type: ignore[no-untyped-def]
    original = DecodeState.snapshot

    def snapshot(self: DecodeState):  # type: ignore[no-untyped-def]
        cycle = list(self._cycle)
        snap = original(self)
        self._cycle = cycle  # the steady cycle goes on writing the pinned buffers
        return snap

    return snapshot


@pytest.mark.parametrize("inplace", [True, False])
def test_a_step_that_fails_inside_onnxruntime_commits_nothing_or_asks_for_a_reset(
    family_dirs: dict[str, Path], inplace: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane step that fails after onnxruntime ran: double-buffered states are untouched (the next step
    equals a run that never failed); states updated in place may be half-written, so the state refuses
    to run until reset, and after reset() decodes as a fresh one."""
    session = _session(family_dirs["hybrid-genai"], inplace)
    state, reference = session.new_state(64), session.new_state(64)
    for st in (state, reference):
        session.forward(st, ids(PROMPT), 1)
    for t in STEPS[:4]:
        session.step(state, t)
        session.forward(reference, ids(t))
    lane = state.bindings.lanes[state.steps & 1]
    assert lane is not None
    run = lane.run  # type: ignore[attr-defined]

    def fail_after_running(binding: object, options: object) -> None:
        run(binding, options)
        raise RuntimeError("simulated failure after the kernels ran")

    monkeypatch.setattr(lane, "run", fail_after_running)
    with pytest.raises(GenerationError, match="forward over 1 tokens"):
        session.step(state, 7)
    monkeypatch.undo()
    if not inplace:
        np.testing.assert_array_equal(session.step(state, 7), session.forward(reference, ids(7))[0, -1])
        return
    with pytest.raises(GenerationError, match="reset"):
        session.step(state, 7)
    state.reset()
    fresh = session.new_state(64)
    for st in (state, fresh):
        session.forward(st, ids(PROMPT), 1)
    for t in STEPS:
        np.testing.assert_array_equal(session.step(state, t), session.step(fresh, t))
