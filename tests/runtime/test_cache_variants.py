"""Stacked KV, static KV and int32-index variants of every family decode like a plain onnxruntime loop,
speculate like plain greedy, and batch like single runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import ids, spec_of, teacher_forced

import onnxgen
from onnxgen import DraftModel, PromptLookup, SamplingParams
from onnxgen.llm import LLM
from onnxgen.runtime.batch import BatchState
from onnxgen.testing import VARIANTS, build_model, run_teacher_forced

ATOL = 1e-5
LOOP_ATOL = 1e-4  # a hybrid's fast ops round differently from the ops a plain loop runs (~4e-5)
N = 16
PROMPT = [5, 17, 200, 33, 44, 91, 12, 8]
# The int4 draft of each family (the plain-ONNX families borrow the int4 export of their twin).
DRAFT = {
    "genai-dense": "genai-dense",
    "standard-dense": "genai-dense",
    "hybrid-genai": "hybrid-genai",
    "hybrid-mobius": "hybrid-mobius",
    "hybrid-scan": "hybrid-mobius",
}
IDS = [f"{family}-{kv}-{dtype}" for family, kv, dtype in VARIANTS]


class Zoo:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.llms: dict[tuple[str, ...], LLM] = {}

    def dir(self, family: str, kv: str = "split", dtype: str = "int64", precision: str = "fp32") -> Path:
        out = self.root / f"{family}-{kv}-{dtype}-{precision}"
        if not (out / "model.onnx").is_file():
            build_model(out, family, spec_of(family), kv=kv, index_dtype=dtype, precision=precision)
        return out

    def llm(self, *key: str) -> LLM:
        if key not in self.llms:
            self.llms[key] = onnxgen.load(self.dir(*key), threads=1)
        return self.llms[key]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("cache-variants"))


@pytest.mark.parametrize(("family", "kv", "dtype"), VARIANTS, ids=IDS)
def test_each_variant_is_derived_with_its_cache_layout_and_the_graphs_index_types(
    zoo: Zoo, family: str, kv: str, dtype: str
) -> None:
    io = zoo.llm(family, kv, dtype).io
    layouts = {pair.layout for pair in io.kv_pairs}
    assert layouts == {"stacked" if kv == "stacked" else "static" if kv == "static" else "BNSH"}
    assert io.kv_mode == ("static" if kv == "static" else "growing" if kv == "stacked" else io.kv_mode)
    if kv == "static":
        assert io.static_cache is not None and io.attention_mask is None
        assert io.static_cache.length == spec_of(family).max_position
    for name in (io.token_input, io.attention_mask, io.position_ids):
        if name is not None:
            assert io.port(name).dtype == dtype


@pytest.mark.parametrize(("family", "kv", "dtype"), VARIANTS, ids=IDS)
def test_greedy_tokens_and_logits_equal_a_plain_onnxruntime_loop_over_the_same_tokens(
    zoo: Zoo, family: str, kv: str, dtype: str
) -> None:
    llm = zoo.llm(family, kv, dtype)
    tokens = llm.generate(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True)).token_ids
    assert len(set(tokens)) >= 4  # a varied continuation, so the comparison below is not vacuous
    plain = run_teacher_forced(zoo.dir(family, kv, dtype), [PROMPT], [tokens])[0]
    assert plain[len(PROMPT) - 1 : -1].argmax(axis=-1).tolist() == tokens
    ours = teacher_forced(llm.session, llm.session.new_state(64), PROMPT, tokens)
    np.testing.assert_allclose(ours, plain[len(PROMPT) - 1 :], atol=LOOP_ATOL, rtol=0)


DENSE_VARIANTS = [v for v in VARIANTS if not v[0].startswith("hybrid")]
STATIC_VARIANTS = [v for v in VARIANTS if v[1] == "static"]


@pytest.mark.parametrize(("family", "kv", "dtype"), DENSE_VARIANTS, ids=lambda v: str(v))
def test_a_rewound_cache_forgets_tokens_and_feeding_them_again_restores_the_logits(
    zoo: Zoo, family: str, kv: str, dtype: str
) -> None:
    session = zoo.llm(family, kv, dtype).session
    state = session.new_state(64)
    session.forward(state, ids(PROMPT), 1)
    before = session.forward(state, ids(7), 1)[0, -1].copy()
    state.rewind(len(PROMPT) - 2)  # two prompt tokens forgotten: another context (negative control)
    assert np.abs(session.forward(state, ids(7), 1)[0, -1] - before).max() > 1e-3
    state.rewind(len(PROMPT) - 2)
    session.forward(state, ids(PROMPT[-2:]), 1)
    np.testing.assert_allclose(session.forward(state, ids(7), 1)[0, -1], before, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("family", "kv", "dtype"), STATIC_VARIANTS, ids=lambda v: str(v))
def test_a_static_cache_is_read_up_to_the_sequence_length_only(
    zoo: Zoo, family: str, kv: str, dtype: str
) -> None:
    session = zoo.llm(family, kv, dtype).session
    state = session.new_state(64)
    session.forward(state, ids(PROMPT), 1)
    snap = state.snapshot()
    before = session.forward(state, ids(7), 1)[0, -1].copy()
    state.restore(snap)
    for buffer in state._kv_shared:  # the positions after the sequence hold garbage: nothing changes
        buffer.array[:, len(PROMPT) + 1 :] = 1e3
    np.testing.assert_array_equal(session.forward(state, ids(7), 1)[0, -1], before)
    state.restore(snap)
    for buffer in state._kv_shared:  # a live position changed: the logits change (negative control)
        buffer.array[:, 1] += 1.0
    assert np.abs(session.forward(state, ids(7), 1)[0, -1] - before).max() > 1e-3


def _repeating(llm: LLM) -> list[int]:
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True)).token_ids
    return [*PROMPT, *out, *PROMPT, *out[:6]]


@pytest.mark.parametrize(("family", "kv", "dtype"), VARIANTS, ids=IDS)
def test_speculative_greedy_with_rejected_drafts_emits_the_plain_greedy_tokens(
    zoo: Zoo, family: str, kv: str, dtype: str
) -> None:
    llm = zoo.llm(family, kv, dtype)
    greedy = SamplingParams(max_new_tokens=N, ignore_eos=True)
    prompt = _repeating(llm)
    plain = llm.generate(prompt, greedy).token_ids
    lookup = llm.generate(prompt, greedy, speculative=PromptLookup(num_draft_tokens=4))
    assert lookup.token_ids == plain
    assert lookup.stats["accepted_draft_tokens"] > 0
    draft = zoo.llm(DRAFT[family], "split", "int64", "int4")
    drafted = llm.generate(PROMPT, greedy, speculative=DraftModel(draft, num_draft_tokens=4))
    assert drafted.token_ids == llm.generate(PROMPT, greedy).token_ids
    stats = drafted.stats
    assert 0 < stats["accepted_draft_tokens"] < stats["proposed_draft_tokens"]  # rewinds happened


def _sequence(seed: int, length: int) -> list[int]:
    return [(37 * i + 11 + 7 * seed) % 300 + 3 for i in range(length)]


@pytest.mark.parametrize(("family", "kv", "dtype"), VARIANTS, ids=IDS)
def test_batched_rows_of_different_lengths_equal_each_sequence_run_alone(
    zoo: Zoo, family: str, kv: str, dtype: str
) -> None:
    session = zoo.llm(family, kv, dtype).session
    rows = [(_sequence(k, plen), _sequence(k + 50, 5)) for k, plen in enumerate((3, 11, 6))]
    alone = [teacher_forced(session, session.new_state(64), p, c) for p, c in rows]
    batch = BatchState(session, 4, 64)
    got: list[list[np.ndarray]] = []
    for prompt, _ in rows:
        state = session.new_state(64)
        got.append([session.forward(state, ids(prompt), 1)[0, -1]])
        batch.admit(state)
    for t in range(5):
        out = batch.step([c[t] for _, c in rows])
        for r in range(len(rows)):
            got[r].append(out[r])
    batch.retire(0)  # the last row moves into row 0 and goes on
    moved = batch.step([9, rows[1][1][-1]])
    for r in range(len(rows)):
        np.testing.assert_allclose(np.stack(got[r]), alone[r], atol=ATOL, rtol=0, err_msg=f"row {r}")
    last = teacher_forced(session, session.new_state(64), rows[2][0], [*rows[2][1], 9])[-1]
    np.testing.assert_allclose(moved[0], last, atol=ATOL, rtol=0)
