"""BatchState: rows of different lengths and admission times decode exactly like each sequence alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from runtime_helpers import DENSE_FAMILIES, HYBRID_FAMILIES, ids, open_session, teacher_forced

from onnxgen.errors import GenerationError
from onnxgen.runtime import batch as batch_module
from onnxgen.runtime.batch import BatchState, invariant_min_rows, lone_row_matches_block
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import build_model, int8_activations

FAMILIES = DENSE_FAMILIES + HYBRID_FAMILIES
ATOL = 1e-5
CAPACITY = 64


def sequence(seed: int, length: int) -> list[int]:
    return [(37 * i + 11 + 7 * seed) % 300 + 3 for i in range(length)]


# (prompt, continuation fed one token per step): different prompt and continuation lengths.
ROWS = [
    (sequence(k, plen), sequence(k + 50, steps))
    for k, (plen, steps) in enumerate([(3, 9), (11, 6), (17, 8), (5, 4)])
]


def prefill(session: DecoderSession, prompt: list[int]) -> tuple[object, np.ndarray]:
    state = session.new_state(CAPACITY)
    return state, session.forward(state, ids(prompt), 1)[0, -1]


class Driver:
    """Feeds each admitted row its continuation, one token per batched step; collects logits per sequence."""

    def __init__(self, session: DecoderSession, max_batch: int) -> None:
        self.session = session
        self.batch = BatchState(session, max_batch, CAPACITY)
        self.rows: list[int] = []  # sequence index of each live row
        self.fed = {k: 0 for k in range(len(ROWS))}
        self.logits: dict[int, list[np.ndarray]] = {}

    def admit(self, k: int) -> None:
        state, first = prefill(self.session, ROWS[k][0])
        assert self.batch.admit(state) == len(self.rows)  # type: ignore[arg-type]
        self.rows.append(k)
        self.logits[k] = [first]

    def step(self) -> None:
        tokens = [ROWS[k][1][self.fed[k]] for k in self.rows]
        out = self.batch.step(tokens)
        for r, k in enumerate(self.rows):
            self.fed[k] += 1
            self.logits[k].append(out[r])

    def retire_finished(self) -> None:
        for r in reversed(range(len(self.rows))):
            k = self.rows[r]
            if self.fed[k] == len(ROWS[k][1]):
                self.retire(r)

    def retire(self, r: int) -> None:
        moved = self.batch.retire(r)
        last = self.rows.pop()
        if moved is not None:
            self.rows[r] = last


@pytest.fixture(scope="module")
def alone(sessions: dict[str, DecoderSession]) -> dict[str, list[np.ndarray]]:
    """Per family, per sequence: the prefill logits and every step's logits of the sequence run alone."""
    return {
        family: [teacher_forced(session, session.new_state(CAPACITY), p, c) for p, c in ROWS]
        for family, session in sessions.items()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_of_different_lengths_admitted_at_different_steps_give_the_logits_of_each_sequence_alone(
    sessions: dict[str, DecoderSession], alone: dict[str, list[np.ndarray]], family: str
) -> None:
    driver = Driver(sessions[family], max_batch=3)
    pending = list(range(len(ROWS)))
    step = 0
    while pending or driver.rows:
        if pending and driver.batch.free_rows and step % 2 == 0:  # admit between steps, mid-decode
            driver.admit(pending.pop(0))
        if driver.rows:
            driver.step()
            driver.retire_finished()
        step += 1
    assert driver.batch.n == 0
    for k in range(len(ROWS)):
        np.testing.assert_allclose(np.stack(driver.logits[k]), alone[family][k], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_admitted_mid_decode_leaves_the_running_row_unchanged(
    sessions: dict[str, DecoderSession], alone: dict[str, list[np.ndarray]], family: str
) -> None:
    driver = Driver(sessions[family], max_batch=2)
    driver.admit(0)
    for _ in range(4):
        driver.step()
    driver.admit(2)  # the longest prompt joins a row that is already 4 tokens into its decode
    while driver.fed[0] < len(ROWS[0][1]):
        driver.step()
    np.testing.assert_allclose(np.stack(driver.logits[0]), alone[family][0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        np.stack(driver.logits[2]), alone[family][2][: len(driver.logits[2])], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_retiring_a_middle_row_moves_the_last_row_into_its_slot_and_keeps_every_output(
    sessions: dict[str, DecoderSession], alone: dict[str, list[np.ndarray]], family: str
) -> None:
    driver = Driver(sessions[family], max_batch=4)
    for k in (0, 1, 2):
        driver.admit(k)
    driver.step()
    driver.step()
    kv_before = driver.batch.row_kv(2)
    states_before = driver.batch.row_states(2)
    driver.retire(1)  # sequence 1 leaves early; sequence 2 moves from row 2 to row 1
    assert driver.rows == [0, 2] and driver.batch.n == 2
    for name, value in driver.batch.row_kv(1).items():
        np.testing.assert_array_equal(value, kv_before[name], err_msg=name)
    for name, value in driver.batch.row_states(1).items():
        np.testing.assert_array_equal(value, states_before[name], err_msg=name)
    while driver.rows:
        driver.step()
        driver.retire_finished()
    for k in (0, 2):
        np.testing.assert_allclose(np.stack(driver.logits[k]), alone[family][k], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_rows_recurrent_state_after_batched_steps_is_the_state_of_the_sequence_run_alone(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    batch = BatchState(session, 3, CAPACITY)
    (p0, c0), (p1, c1) = ROWS[0], ROWS[2]
    for prompt in (p0, p1):
        batch.admit(prefill(session, prompt)[0])  # type: ignore[arg-type]
    for t0, t1 in zip(c0[:4], c1[:4], strict=True):
        batch.step([t0, t1])
    ref = session.new_state(CAPACITY)
    teacher_forced(session, ref, p1, c1[:4])
    assert batch.lengths[1] == ref.length == len(p1) + 4
    for name, value in batch.row_states(1).items():
        np.testing.assert_allclose(value, ref.state_arrays()[name][0], atol=ATOL, rtol=0, err_msg=name)
    for name, value in batch.row_kv(1).items():
        np.testing.assert_allclose(value, ref.kv_arrays()[name][0], atol=ATOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_row_gives_a_decode_state_the_rows_kv_and_states_bit_for_bit(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    """The inverse of admit (a speculative sequence going back to its lane): a row loaded into a batch-1
    state that held another sequence holds the row's tokens, KV and states exactly; it decodes on as the
    row does, and admitted again it is the same row."""
    session = sessions[family]
    batch = BatchState(session, 3, CAPACITY)
    (p0, c0), (p2, c2) = ROWS[0], ROWS[2]
    for prompt in (p0, p2):
        batch.admit(prefill(session, prompt)[0])  # type: ignore[arg-type]
    for t0, t2 in zip(c0[:3], c2[:3], strict=True):
        batch.step([t0, t2])
    state = prefill(session, ROWS[1][0])[0]  # another sequence: load_row empties the state first
    batch.load_row(1, state)  # type: ignore[arg-type]
    assert state.length == batch.lengths[1] == len(p2) + 3  # type: ignore[attr-defined]
    axes = {name: pair.batch_axis for pair in session.io.kv_pairs for name in pair.inputs}
    kv, states = state.kv_arrays(), state.state_arrays()  # type: ignore[attr-defined]
    for name, value in batch.row_kv(1).items():
        np.testing.assert_array_equal(np.take(kv[name], 0, axis=axes[name]), value, err_msg=name)
    for name, value in batch.row_states(1).items():
        np.testing.assert_array_equal(states[name][0], value, err_msg=name)
    again = BatchState(session, 1, CAPACITY)
    again.admit(state)  # type: ignore[arg-type]
    for name, value in batch.row_kv(1).items():
        np.testing.assert_array_equal(again.row_kv(0)[name], value, err_msg=name)
    for t0, t2 in zip(c0[3:6], c2[3:6], strict=True):
        rows = batch.step([t0, t2])
        alone = session.forward(state, ids([t2]), 1)[0, -1]  # type: ignore[arg-type]
        np.testing.assert_allclose(alone, rows[1], atol=ATOL, rtol=0)


def test_a_full_batch_refuses_another_row_and_a_step_needs_one_token_per_row(
    sessions: dict[str, DecoderSession],
) -> None:
    session = sessions["genai-dense"]
    batch = BatchState(session, 1, CAPACITY)
    batch.admit(prefill(session, ROWS[0][0])[0])  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match=r"batch is full \(1 rows\)"):
        batch.admit(prefill(session, ROWS[1][0])[0])  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match=r"one token per live row \(1 rows, got 2"):
        batch.step([1, 2])


def test_a_step_past_a_rows_capacity_is_refused_and_changes_nothing(
    sessions: dict[str, DecoderSession],
) -> None:
    session = sessions["hybrid-genai"]
    batch = BatchState(session, 2, 8)
    batch.admit(prefill(session, sequence(0, 6))[0])  # type: ignore[arg-type]
    batch.step([4])
    batch.step([4])  # the row now holds 8 tokens, its whole capacity
    states = batch.row_states(0)
    with pytest.raises(GenerationError, match="capacity of 8 tokens"):
        batch.step([4])
    assert batch.lengths[0] == 8
    for name, value in batch.row_states(0).items():
        np.testing.assert_array_equal(value, states[name])


def test_a_prefilled_sequence_longer_than_a_row_is_refused(sessions: dict[str, DecoderSession]) -> None:
    session = sessions["genai-dense"]
    batch = BatchState(session, 2, 8)
    with pytest.raises(GenerationError, match="9 tokens does not fit a batch row of 8"):
        batch.admit(prefill(session, sequence(1, 9))[0])  # type: ignore[arg-type]
    assert batch.n == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_idle_rows_padding_a_forward_to_min_rows_change_no_live_rows_output(
    sessions: dict[str, DecoderSession], alone: dict[str, list[np.ndarray]], family: str
) -> None:
    driver = Driver(sessions[family], max_batch=4)
    driver.batch = BatchState(sessions[family], 4, CAPACITY, min_rows=3)
    driver.admit(0)  # alone: two idle rows pad each forward
    driver.step()
    driver.admit(1)  # admitted into a row that idled until now
    pending = [2, 3]
    while driver.rows or pending:
        if pending and driver.batch.free_rows:
            driver.admit(pending.pop(0))
        driver.step()
        driver.retire_finished()
    for k in range(len(ROWS)):
        np.testing.assert_allclose(np.stack(driver.logits[k]), alone[family][k], atol=ATOL, rtol=0)


def int8_activation_model(root: Path) -> Path:
    """The tiny dense int4 export with MatMulNBits set to int8 activations (accuracy_level 4), as the
    onnxruntime-genai builder writes them: onnxruntime computes a single row differently from a block."""
    return int8_activations(build_model(root, "genai-dense", precision="int4"))


def lone_and_beside(session: DecoderSession, min_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits of one sequence over 10 steps decoded alone, and beside another sequence."""
    prompts = [[(37 * i + 11 * k) % 300 + 3 for i in range(length)] for k, length in enumerate((5, 9))]
    out = []
    for company in (False, True):
        batch = BatchState(session, 2, CAPACITY, min_rows=min_rows)
        for prompt in prompts[: 1 + company]:
            batch.admit(prefill(session, prompt)[0])  # type: ignore[arg-type]
        out.append(np.stack([batch.step([7 + t] * batch.n)[0] for t in range(10)]))
    return out[0], out[1]


def test_with_two_min_rows_a_sequence_gets_the_same_logits_alone_or_beside_another(tmp_path: Path) -> None:
    session = open_session(int8_activation_model(tmp_path / "int8"))
    lone, beside = lone_and_beside(session, min_rows=2)
    np.testing.assert_array_equal(lone, beside)


def in_a_block(session: DecoderSession, rows: int, position: int, own_token: int = 7) -> np.ndarray:
    """Logits of one sequence over 6 steps, decoded as row ``position`` of ``rows`` (the others: other
    prompts), fed ``own_token + t`` at step ``t``."""
    prompts = [[(37 * i + 11 * k) % 300 + 3 for i in range(5 + k)] for k in range(rows)]
    order = list(range(1, rows))
    order.insert(position, 0)
    batch = BatchState(session, rows, CAPACITY, min_rows=2)
    for k in order:
        batch.admit(prefill(session, prompts[k])[0])  # type: ignore[arg-type]
    out = []
    for t in range(6):
        tokens = [7 + t] * rows
        tokens[position] = own_token + t
        out.append(batch.step(tokens)[position])
    return np.stack(out)


def test_with_int8_activations_a_sequence_gets_the_same_logits_in_any_block_of_two_to_eight_rows(
    tmp_path: Path,
) -> None:
    """Blocks of any size (odd ones too: a kernel that tiles rows in pairs computes a left-over row apart)
    and any position in them give a sequence the same bits, so the server's 8-row steps keep it
    batch-invariant; the last check shows the compared row is the sequence's own (another token there
    changes it)."""
    session = open_session(int8_activation_model(tmp_path / "int8"))
    reference = in_a_block(session, 2, 0)
    for rows in range(2, 9):
        for position in (0, rows // 2, rows - 1):
            np.testing.assert_array_equal(
                in_a_block(session, rows, position), reference, f"{rows} rows, row {position}"
            )
    assert not np.array_equal(in_a_block(session, 5, 2, own_token=9), reference)


def test_with_one_min_row_int8_kernels_compute_a_lone_row_differently(tmp_path: Path) -> None:
    """Why the padding exists (the negative control of the test above). Which kernels onnxruntime picks
    depends on the CPU: with AVX2 only (AMD EPYC Milan here) a lone row goes through another kernel than a
    block of two and the logits differ by more than 1e-3; with AVX-512 VNNI (EPYC Genoa) both went through one, and
    there is nothing to show."""
    session = open_session(int8_activation_model(tmp_path / "int8"))
    lone, beside = lone_and_beside(session, min_rows=1)
    if np.array_equal(lone, beside):
        pytest.skip("onnxruntime's int8 kernels compute a lone row as they compute two rows on this CPU")
    assert np.abs(lone - beside).max() > 1e-3


def test_invariant_min_rows_pads_only_exports_whose_kernels_compute_a_lone_row_differently(
    tmp_path: Path, family_dirs: dict[str, Path]
) -> None:
    assert (
        invariant_min_rows(
            onnx.load(str(family_dirs["genai-dense"] / "model.onnx"), load_external_data=False)
        )
        == 1
    )
    int4 = build_model(tmp_path / "int4", "genai-dense", precision="int4")  # fp32 activations
    assert invariant_min_rows(onnx.load(str(int4 / "model.onnx"), load_external_data=False)) == 2
    int8 = int8_activation_model(tmp_path / "int8")
    assert invariant_min_rows(onnx.load(str(int8 / "model.onnx"), load_external_data=False)) == 2


def test_with_the_session_the_padding_follows_what_this_cpu_computes(
    tmp_path: Path, family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe agrees with 10 steps of two other prompts, alone and beside another; fp32 exports are
    not probed."""
    int8 = int8_activation_model(tmp_path / "int8")
    graph = onnx.load(str(int8 / "model.onnx"), load_external_data=False)
    session = open_session(int8)
    lone, beside = lone_and_beside(session, min_rows=1)
    assert invariant_min_rows(graph, session) == (1 if np.array_equal(lone, beside) else 2)
    int4 = build_model(tmp_path / "int4", "genai-dense", precision="int4")  # fp32 activations
    session = open_session(int4)
    lone, beside = lone_and_beside(session, min_rows=1)
    graph = onnx.load(str(int4 / "model.onnx"), load_external_data=False)
    assert invariant_min_rows(graph, session) == (1 if np.array_equal(lone, beside) else 2)
    dense = family_dirs["genai-dense"]
    monkeypatch.setattr(batch_module, "lone_row_matches_block", _never_called)
    assert invariant_min_rows(onnx.load(str(dense / "model.onnx"), load_external_data=False), session) == 1


def _never_called(session: DecoderSession) -> bool:
    raise AssertionError("an fp32 export was probed")


def test_the_probe_sees_a_lone_row_computed_differently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control on any CPU: a single-row step that rounds one logit differently is caught."""
    session = open_session(int8_activation_model(tmp_path / "int8"))
    real_step = BatchState.step

    def lone_rounds_differently(self: BatchState, tokens: list[int]) -> np.ndarray:
        logits = real_step(self, tokens)
        if self.bound_rows == 1:
            logits[0, 5] = np.nextafter(logits[0, 5], np.inf)
        return logits

    monkeypatch.setattr(BatchState, "step", lone_rounds_differently)
    assert not lone_row_matches_block(session)
    graph = onnx.load(str(tmp_path / "int8" / "model.onnx"), load_external_data=False)
    assert invariant_min_rows(graph, session) == 2


@pytest.mark.parametrize("family", ["hybrid-genai", "hybrid-mobius"])
def test_rows_updated_in_place_equal_double_buffered_rows_bit_for_bit(
    family_dirs: dict[str, Path], family: str
) -> None:
    """Batched steps over a session that updates its LinearAttention states in place give the logits and
    row states of one that double-buffers them, through admissions at different steps and a retirement."""
    from onnxgen.model.package import ModelPackage

    io = ModelPackage.open(family_dirs[family]).io
    model = family_dirs[family] / "model.onnx"
    runs = []
    for inplace in (True, False):
        session = DecoderSession(session_graph(model, io), threads=1, inplace=inplace)
        assert bool(session.inplace_states) == inplace
        driver = Driver(session, 3)
        driver.admit(0)
        driver.admit(1)
        for _ in range(3):
            driver.step()
        driver.admit(2)
        driver.retire(0)  # the last row moves into row 0
        for _ in range(3):
            driver.step()
        states = [driver.batch.row_states(r) for r in range(driver.batch.n)]
        runs.append((driver.logits, states))
    (got, got_states), (want, want_states) = runs
    assert got.keys() == want.keys()
    for k in want:
        for a, b in zip(got[k], want[k], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {k}")
    for a, b in zip(got_states, want_states, strict=True):
        for name in b:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_admitted_from_one_reused_prefill_state_keep_their_own_kv_and_states(
    sessions: dict[str, DecoderSession], alone: dict[str, list[np.ndarray]], family: str
) -> None:
    """The scheduler prefills every prompt in one state and admits from it: a row must hold copies, not
    views of that state, which the next prompt's prefill (here: garbage written into it) overwrites."""
    session = sessions[family]
    batch = BatchState(session, 2, CAPACITY)
    state = session.new_state(CAPACITY)
    firsts = []
    for k in (0, 2):
        state.reset()
        firsts.append(session.forward(state, ids(ROWS[k][0]), 1)[0, -1])
        batch.admit(state)
    before = session.forward(state, ids([ROWS[2][1][0]]), 1)[0, -1]  # the state's own next step
    state.reset()
    session.forward(state, ids(ROWS[2][0]), 1)
    for array in (*state.kv_arrays(copy=False).values(), *state.state_arrays(copy=False).values()):
        array[...] = 0.5  # garbage where the admitted rows' data came from
    after = session.forward(state, ids([ROWS[2][1][0]]), 1)[0, -1]
    assert not np.allclose(after, before, atol=ATOL)  # control: the garbage changes what the state computes
    steps = min(len(ROWS[0][1]), len(ROWS[2][1]))
    stepped = np.stack([batch.step([ROWS[0][1][t], ROWS[2][1][t]]) for t in range(steps)])
    for i, k in enumerate((0, 2)):
        logits = np.concatenate([firsts[i][None], stepped[:, i]])
        np.testing.assert_allclose(logits, alone[family][k][: steps + 1], atol=ATOL, rtol=0)
