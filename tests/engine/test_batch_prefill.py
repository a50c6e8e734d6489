"""Batched prefill: equal-length prompts of one scheduler step run as one multi-row forward, and each gets
the logits and states (KV, recurrent, conv) it gets prefilled alone, bit for bit.

Checked on dense and hybrid tiny models, fp32 and int4 (on fp32 and on int8 activations, whose kernels
compute a lone row differently from a block: the prefill keeps two positions' logits there), with a
growing-KV export too; against the same scheduler with batched prefill off. Negative controls: a row admitted from the
wrong row of the batch, or with its state corrupted, changes that sequence's tokens and no other's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import onnxgen
from onnxgen import LLM, SamplingParams
from onnxgen.engine.engine import Engine
from onnxgen.engine.limits import BatchLimits
from onnxgen.engine.scheduler import Scheduler
from onnxgen.engine.sequence import Sequence
from onnxgen.errors import GenerationError
from onnxgen.runtime.batch import BatchState
from onnxgen.runtime.observer import ForwardEvent
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState
from onnxgen.testing import build_model, int8_activations

# lengths of different classes, several of each: (3: three prompts, 6: two, 9: two, 2 and 5: one)
LENGTHS = (3, 6, 3, 9, 2, 6, 3, 9, 5)
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def prompt(k: int, length: int) -> list[int]:
    return [(37 * i + 11 * k + 5) % 300 + 3 for i in range(length)]


PROMPTS = [prompt(k, n) for k, n in enumerate(LENGTHS)]

MODELS = {
    "dense-fp32": ("genai-dense", "fp32"),
    "hybrid-fp32": ("hybrid-genai", "fp32"),
    "dense-int4": ("genai-dense", "int4"),
    "dense-int8": ("genai-dense", "int8"),
    "hybrid-int8": ("hybrid-genai", "int8"),
    "hybrid-growing-kv": ("hybrid-mobius", "fp32"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, precision = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    if precision == "int8":
        return int8_activations(build_model(root, family, precision="int4"))
    return build_model(root, family, precision=precision)


def load(model: Path, batch_prefill: bool, **overrides: object) -> LLM:
    settings: dict[str, object] = {"max_batch": 12, "prefill_chunk": 64, **overrides}
    llm = onnxgen.load(model, threads=1, batch_prefill=batch_prefill, **settings)
    llm.engine()  # (its limits resolved: the min_rows probe runs forwards of its own)
    return llm


def observed(llm: LLM) -> list[ForwardEvent]:
    """The forwards ``llm``'s session runs from now on (its observer replaced)."""
    events: list[ForwardEvent] = []
    llm.session.forward_observer = events.append
    return events


def prefill_rows(llm: LLM, prompts: list[list[int]]) -> tuple[list[np.ndarray], list[dict[str, np.ndarray]]]:
    """Each prompt's first-token logits and its batch row's KV and states right after the prefill (the
    engine's scheduler, one step, no decode step run)."""
    scheduler = llm.engine().scheduler
    got: dict[int, np.ndarray] = {}
    start = scheduler._start

    def keep_logits(seq: Sequence, logits: np.ndarray, *args: object) -> None:
        got[id(seq)] = logits.copy()
        start(seq, logits, *args)  # type: ignore[arg-type]

    scheduler._start = keep_logits  # type: ignore[method-assign]
    scheduler._decode = lambda touched: None  # type: ignore[method-assign]
    for k, p in enumerate(prompts):
        llm.engine().add_request(k, p, GREEDY)
    seqs = [group[0] for group in scheduler.waiting]
    scheduler.step()
    rows = []
    for seq in seqs:
        assert seq.slot is not None
        rows.append({**scheduler.batch.row_kv(seq.slot), **scheduler.batch.row_states(seq.slot)})
    return [got[id(seq)] for seq in seqs], rows


def test_a_batched_prefill_gives_every_prompt_its_logits_and_states_alone_bit_for_bit(model: Path) -> None:
    batched, alone = load(model, True), load(model, False)
    events = observed(batched)
    logits, rows = prefill_rows(batched, PROMPTS)
    want_logits, want_rows = prefill_rows(alone, PROMPTS)
    prefills = [(e.batch, e.tokens) for e in events if e.phase == "prefill"]
    # equal lengths within the step's budget of 64 tokens share a forward, the rest run alone
    assert sorted(prefills) == [(1, 2), (1, 5), (2, 6), (2, 9), (3, 3)]
    for k in range(len(PROMPTS)):
        np.testing.assert_array_equal(logits[k], want_logits[k], f"prompt {k}")
        assert rows[k].keys() == want_rows[k].keys()
        for name, value in rows[k].items():
            np.testing.assert_array_equal(value, want_rows[k][name], f"prompt {k}, {name}")
    if batched.session.io.state_pairs:  # the hybrid's recurrent and conv states are there and not zero
        states = {pair.input for pair in batched.session.io.state_pairs}
        assert all(np.abs(rows[0][name]).max() > 0 for name in states)


def test_greedy_and_sampled_requests_get_the_tokens_of_an_unbatched_prefill(model: Path) -> None:
    params = [
        GREEDY if k % 3 else SamplingParams(max_new_tokens=6, temperature=0.8, seed=k, ignore_eos=True)
        for k in range(len(PROMPTS))
    ]
    batched, alone = load(model, True), load(model, False)
    events = observed(batched)
    got = batched.generate(PROMPTS, params)
    assert max(e.batch for e in events if e.phase == "prefill") == 3  # (it did batch)
    assert [r.token_ids for r in got] == [r.token_ids for r in alone.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("hybrid"), "hybrid-genai")


def admitting(change: Callable[[BatchState, int, int], None]) -> Callable[..., int]:
    """``BatchState.admit`` that calls ``change(batch, row, source)`` after admitting a batched prefill's row."""
    admit = BatchState.admit

    def patched(self: BatchState, prefilled: DecodeState, source: int = 0) -> int:
        row = admit(self, prefilled, source)
        if prefilled.batch > 1:
            change(self, row, source)
        return row

    return patched


def tokens_before_and_after(
    model: Path, monkeypatch: pytest.MonkeyPatch, owner: type, name: str, replacement: Callable[..., object]
) -> tuple[list[list[int]], list[list[int]]]:
    """The batched-prefill engine's greedy tokens for :data:`PROMPTS`, then again with ``owner.name``
    replaced by ``replacement``."""
    llm = load(model, True)
    want = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    monkeypatch.setattr(owner, name, replacement)
    return want, [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def corrupt_source_row(batch: BatchState, row: int, source: int) -> None:
    if source == 1:
        for buf in batch._states:
            buf.array[row] *= 0.5


def test_corrupting_one_rows_state_changes_that_prompts_tokens_and_no_other(
    hybrid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the prompts of length 3 share one forward; halving the recurrent states admitted
    from its second row changes that prompt's tokens only."""
    want, got = tokens_before_and_after(
        hybrid, monkeypatch, BatchState, "admit", admitting(corrupt_source_row)
    )
    changed = [k for k in range(len(PROMPTS)) if got[k] != want[k]]
    second_of_each = [2, 5, 7]  # the second prompt of lengths 3, 6 and 9 (row 1 of their forwards)
    assert changed == second_of_each


def test_a_row_admitted_from_the_wrong_row_of_the_batch_would_be_caught(
    hybrid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admit = BatchState.admit

    def shifted(self: BatchState, prefilled: DecodeState, source: int = 0) -> int:
        return admit(self, prefilled, (source + 1) % prefilled.batch)

    want, got = tokens_before_and_after(hybrid, monkeypatch, BatchState, "admit", shifted)
    assert got[0] != want[0] and got[4] == want[4]  # (prompt 4 runs alone: 2 tokens, no company)


# -- where it does not batch --------------------------------------------------------------------------------
def prefill_shapes(llm: LLM, prompts: list[list[int]]) -> Iterator[tuple[int, int]]:
    events = observed(llm)
    llm.generate(prompts, GREEDY)
    return ((e.batch, e.tokens) for e in events if e.phase == "prefill")


def test_only_prompts_the_step_prefills_anyway_share_a_forward(hybrid: Path) -> None:
    """The budget (here 8 tokens) and the queue order hold: four 4-token prompts take two steps of two."""
    llm = load(hybrid, True, prefill_chunk=8)
    assert list(prefill_shapes(llm, [prompt(k, 4) for k in range(4)])) == [(2, 4), (2, 4)]


def test_one_token_prompts_prompts_over_a_chunk_and_the_prefix_cache_prefill_alone(hybrid: Path) -> None:
    llm = load(hybrid, True, prefill_chunk=4)
    shapes = list(prefill_shapes(llm, [prompt(0, 1), prompt(1, 1), prompt(2, 6), prompt(3, 6)]))
    assert shapes == [(1, 1), (1, 1), (1, 4), (1, 2), (1, 4), (1, 2)]
    cached = load(hybrid, True, prefix_cache_mb=8)
    assert set(prefill_shapes(cached, [prompt(k, 5) for k in range(3)])) == {(1, 4), (1, 1)}
    off = load(hybrid, False)
    assert set(prefill_shapes(off, [prompt(k, 5) for k in range(3)])) == {(1, 5)}


def test_a_failed_batched_forward_is_retried_one_prompt_at_a_time(
    hybrid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forward = DecoderSession.forward

    def refuse_batches(self: DecoderSession, state: DecodeState, ids: np.ndarray, *a: object, **k: object):
        if ids.shape[0] > 1:
            raise GenerationError("a batched forward failed")
        return forward(self, state, ids, *a, **k)  # type: ignore[arg-type]

    want, got = tokens_before_and_after(hybrid, monkeypatch, DecoderSession, "forward", refuse_batches)
    assert got == want


def test_the_cohort_states_hold_no_more_rows_than_the_batch(hybrid: Path) -> None:
    llm = load(hybrid, True, max_batch=4)
    engine = Engine(llm.generator, BatchLimits(max_batch=4, max_model_len=64))
    scheduler: Scheduler = engine.scheduler
    for rows in (2, 3, 2, 4):
        state = scheduler._cohort_state(rows)
        assert state.batch == rows and state.length == 0
        assert sum(scheduler._cohort_states) <= 4


def test_admit_refuses_a_row_the_prefilled_state_lacks(hybrid: Path) -> None:
    llm = load(hybrid, True)
    state = llm.session.new_state(16, batch=2)
    llm.session.forward(state, np.array([prompt(0, 3), prompt(1, 3)]), 1)
    batch = BatchState(llm.session, 2, 16)
    with pytest.raises(ValueError, match=r"source must be a row of the prefilled state, in \[0, 2\)"):
        batch.admit(state, 2)
    assert batch.n == 0 and batch.admit(state, 1) == 0
