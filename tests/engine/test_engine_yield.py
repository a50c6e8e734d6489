"""A greedy speculative sequence yields to plain rows: while plain sequences decode it decodes as a batch row
(no lane forward runs beside theirs), and it goes back to its lane when they are gone. The moves copy its
state exactly, so its tokens stay those of plain greedy decoding (and of the library's speculative loop);
corrupting a moved state changes them. A sampled one keeps its lane throughout."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen import LLM, MTP, GenerationError, PromptLookup, SamplingParams
from onnxgen.engine.engine import Engine
from onnxgen.engine.lane import Lane
from onnxgen.engine.scheduler import Scheduler
from onnxgen.generation.speculative import Speculative
from onnxgen.runtime.batch import BatchState
from onnxgen.runtime.state import DecodeState

LOOKUP = PromptLookup(num_draft_tokens=3)
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=3, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=14, temperature=0.8, top_k=50, seed=7, ignore_eos=True)


class Watch:
    """Per engine step: whether a forward ran on a lane's state (a verify, a plain lane step, a lane's
    prefill) and which sequences the batch's forward decoded."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.scheduler = scheduler = engine.scheduler
        self.lane_forward = False
        self.batch_rows: list[Any] = []
        session = scheduler.session
        for name in ("forward", "step"):
            monkeypatch.setattr(session, name, self._counting(getattr(session, name)))
        batch_step = scheduler.batch.step

        def step(tokens: Any) -> np.ndarray:
            self.batch_rows = list(scheduler.running)
            return batch_step(tokens)

        monkeypatch.setattr(scheduler.batch, "step", step)

    def _counting(self, run: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        def counted(state: DecodeState, *args: Any, **kwargs: Any) -> np.ndarray:
            if state is not self.scheduler._prefill_state:
                self.lane_forward = True
            return run(state, *args, **kwargs)

        return counted

    def steps(self, engine: Engine) -> Iterator[list[Any]]:
        while engine.has_unfinished():
            self.lane_forward, self.batch_rows = False, []
            outputs = engine.step()
            yield outputs


def run(engine: Engine, watch: Watch, requests: dict[str, tuple[list[int], SamplingParams, Any]]) -> dict:
    """Queue the requests, step to the end; each one's tokens, and per step the spec request's place
    ("lane" or "row") and whether a lane forward ran beside plain rows in the batch's forward."""
    for rid, (ids, params, speculative) in requests.items():
        engine.add_request(rid, ids, params, speculative)
    tokens: dict[str, list[int]] = {}
    stats: dict[str, dict[str, Any]] = {}
    places: list[str] = []
    beside = 0  # steps in which a lane forward ran while plain rows decoded in the batch
    shared = 0  # steps in which the speculative sequence decoded in the batch beside plain rows
    for outputs in watch.steps(engine):
        plain_rows = [seq for seq in watch.batch_rows if seq.speculative is None]
        beside += bool(watch.lane_forward and plain_rows)
        shared += bool(plain_rows and any(seq.speculative for seq in watch.batch_rows))
        scheduler = engine.scheduler
        place = (
            "lane"
            if scheduler.lanes
            else "row"
            if scheduler.parked or any(s.speculative for s in scheduler.running)
            else None
        )
        if place and (not places or places[-1] != place):
            places.append(place)
        for out in outputs:
            assert out.finish_reason != "error", out.error
            tokens.setdefault(str(out.request_id), []).extend(out.token_ids)
            if out.finish_reason is not None:
                stats[str(out.request_id)] = out.stats or {}
    return {"tokens": tokens, "stats": stats, "places": places, "beside": beside, "shared": shared}


def test_a_greedy_speculative_request_decodes_as_a_row_beside_plain_ones(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(llm.generator, llm.engine().limits, llm.draft_generator)
    watch = Watch(engine, monkeypatch)
    requests = {
        "s": (prompts[0], GREEDY, LOOKUP),
        "a": (prompts[1], GREEDY, None),
        "b": (prompts[2], GREEDY, None),
    }
    got = run(engine, watch, requests)
    monkeypatch.undo()
    assert got["beside"] == 0  # no lane forward while plain rows shared the batch's forward
    assert got["shared"] > 0  # the speculative sequence did decode beside them as a row
    assert engine.scheduler.yields >= 1
    for rid, (ids, params, speculative) in requests.items():
        assert got["tokens"][rid] == llm.generate(ids, params).token_ids  # plain greedy decoding's
        if speculative is not None:
            assert got["tokens"][rid] == llm.generate(ids, params, speculative=speculative).token_ids
    assert not engine.scheduler.parked and engine.scheduler.free_rows == 4


def mid_move(
    llm: LLM,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    speculative: Speculative = LOOKUP,
) -> dict[str, Any]:
    """The speculative request alone in its lane, then beside a short plain request (it moves into a row),
    then alone again (back into its lane): its tokens, final stats and where it was, in order."""
    engine = Engine(llm.generator, llm.engine().limits, llm.draft_generator)
    watch = Watch(engine, monkeypatch)
    engine.add_request("s", prompts[0], LONG, speculative)
    tokens: list[int] = []
    places = ["lane"]
    stats: dict[str, Any] = {}
    added = False
    for outputs in watch.steps(engine):
        for out in outputs:
            assert out.finish_reason != "error", out.error
            if out.request_id == "s":
                tokens += out.token_ids
                stats = out.stats or stats
        if len(tokens) >= 6 and not added:
            engine.add_request("p", prompts[1], SHORT)
            added = True
        place = "lane" if engine.scheduler.lanes else "row" if engine.scheduler.parked else places[-1]
        if places[-1] != place:
            places.append(place)
    return {"tokens": tokens, "places": places, "engine": engine, "stats": stats}


def test_a_move_into_a_row_and_back_mid_generation_is_exact(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    got = mid_move(llm, prompts, monkeypatch)
    monkeypatch.undo()
    assert got["places"] == ["lane", "row", "lane"]
    assert got["engine"].scheduler.yields == got["engine"].scheduler.resumes == 1
    assert got["stats"]["speculation_yields"] == 1 and got["stats"]["batch_row_tokens"] > 0
    assert got["tokens"] == llm.generate(prompts[0], LONG).token_ids
    assert got["tokens"] == llm.generate(prompts[0], LONG, speculative=LOOKUP).token_ids


@pytest.mark.parametrize("direction", ["into-row", "into-lane"])
def test_a_corrupted_move_changes_the_tokens(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """Negative control: the equality above checks the moved states (KV and recurrent states)."""
    if direction == "into-row":
        park = Scheduler._park

        def corrupted_park(self: Scheduler, lane: Lane) -> None:
            state = lane.loop.state
            kv, states = state.kv_arrays, state.state_arrays
            state.kv_arrays = lambda copy=True: {k: np.zeros_like(v) for k, v in kv().items()}  # type: ignore[method-assign]
            state.state_arrays = lambda copy=True: {k: np.zeros_like(v) for k, v in states().items()}  # type: ignore[method-assign]
            try:
                park(self, lane)
            finally:
                del state.kv_arrays, state.state_arrays

        monkeypatch.setattr(Scheduler, "_park", corrupted_park)
    else:
        row_kv, row_states = BatchState.row_kv, BatchState.row_states
        monkeypatch.setattr(
            BatchState, "row_kv", lambda self, r: {k: np.zeros_like(v) for k, v in row_kv(self, r).items()}
        )
        monkeypatch.setattr(
            BatchState,
            "row_states",
            lambda self, r: {k: np.zeros_like(v) for k, v in row_states(self, r).items()},
        )
    got = mid_move(llm, prompts, monkeypatch)
    monkeypatch.undo()
    assert got["places"] == ["lane", "row", "lane"]
    assert got["tokens"] != llm.generate(prompts[0], LONG).token_ids


def test_a_seeded_sampled_speculative_request_keeps_its_lane_beside_plain_rows(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its tokens follow the speculative acceptance rule's draws: the same whatever its company, those
    the library's speculative loop gives it."""
    fixed = PromptLookup(num_draft_tokens=3, adaptive=False)
    engine = Engine(llm.generator, llm.engine().limits, llm.draft_generator)
    watch = Watch(engine, monkeypatch)
    requests = {"s": (prompts[0], SEEDED, fixed), "a": (prompts[1], GREEDY, None)}
    got = run(engine, watch, requests)
    monkeypatch.undo()
    assert engine.scheduler.yields == 0 and got["places"] == ["lane"]
    assert got["tokens"]["s"] == llm.generate(prompts[0], SEEDED, speculative=fixed).token_ids
    assert got["tokens"]["a"] == llm.generate(prompts[1], GREEDY).token_ids


def test_an_unseeded_sampled_speculative_request_yields_and_goes_back_to_its_lane(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tokens were promised for it, so it yields like a greedy one: no lane forward runs beside the
    plain row, which gets its solo tokens; it goes back to its lane (and speculates) once alone."""
    unseeded = SamplingParams(max_new_tokens=40, temperature=0.8, top_k=50, ignore_eos=True)
    engine = Engine(llm.generator, llm.engine().limits, llm.draft_generator)
    watch = Watch(engine, monkeypatch)
    engine.add_request("s", prompts[0], unseeded, LOOKUP)
    tokens: dict[str, list[int]] = {"s": [], "p": []}
    places, beside, stats = ["lane"], 0, {}
    for outputs in watch.steps(engine):
        beside += bool(watch.lane_forward and any(seq.speculative is None for seq in watch.batch_rows))
        for out in outputs:
            assert out.finish_reason != "error", out.error
            tokens[str(out.request_id)] += out.token_ids
            stats = out.stats if out.request_id == "s" and out.stats else stats
        if len(tokens["s"]) >= 6 and not engine.scheduler.running and "row" not in places:
            engine.add_request("p", prompts[1], SHORT)
        scheduler = engine.scheduler
        place = "lane" if scheduler.lanes else "row" if scheduler.parked else places[-1]
        if places[-1] != place:
            places.append(place)
    monkeypatch.undo()
    assert places == ["lane", "row", "lane"] and beside == 0
    assert engine.scheduler.yields == engine.scheduler.resumes == 1 and stats["speculation_yields"] == 1
    assert len(tokens["s"]) == 40 and stats["batch_row_tokens"] > 0
    assert tokens["p"] == llm.generate(prompts[1], SHORT).token_ids


def test_a_request_arriving_beside_plain_rows_starts_as_a_row_and_takes_its_lane_later(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(llm.generator, llm.engine().limits, llm.draft_generator)
    watch = Watch(engine, monkeypatch)
    engine.add_request("a", prompts[1], SamplingParams(max_new_tokens=12, ignore_eos=True))
    while not engine.scheduler.running:
        engine.step()
    got = run(engine, watch, {"s": (prompts[0], LONG, LOOKUP)})
    monkeypatch.undo()
    assert got["places"] == ["row", "lane"] and engine.scheduler.yields == engine.scheduler.resumes == 1
    assert got["stats"]["s"]["speculation_yields"] == 1 and got["stats"]["s"]["proposed_draft_tokens"] > 0
    assert got["beside"] == 0
    assert got["tokens"]["s"] == llm.generate(prompts[0], LONG).token_ids


def test_an_mtp_request_moves_and_its_head_catches_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MTP head reads the target's hidden state at every position: back in its lane, the positions its
    batch row decoded are run once on its own state to hand them over (else its next proposal raises)."""
    llm = onnxgen.load(threads=1, max_batch=3, min_rows=1)  # the bundled model and its trained MTP head
    prompts = [llm.encode(text) for text in ("1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time")]
    mtp = MTP(num_draft_tokens=2, auto=False, adaptive=False)
    got = mid_move(llm, prompts, monkeypatch, mtp)
    monkeypatch.undo()
    assert got["places"] == ["lane", "row", "lane"]
    assert got["tokens"] == llm.generate(prompts[0], LONG).token_ids
    assert got["tokens"] == llm.generate(prompts[0], LONG, speculative=mtp).token_ids
    assert got["stats"]["accepted_draft_tokens"] > 0


def test_moves_with_the_prefix_cache_cache_exact_states(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence that moved finishes in its lane and caches its reply from the lane's state (adopted from
    the row): a follow-up turn resumed from that entry gets plain decoding's tokens; a repeat of the request
    resumes its prompt from the cache and moves again to the same tokens."""
    cached = onnxgen.load(
        llm.package.root, threads=1, max_batch=4, prefill_chunk=4, min_rows=1, prefix_cache_mb=8
    )
    want = llm.generate(prompts[0], LONG).token_ids
    for _ in range(2):
        got = mid_move(cached, prompts, monkeypatch)
        assert got["places"] == ["lane", "row", "lane"] and got["tokens"] == want
    assert got["stats"]["cached_tokens"] > 0
    follow = prompts[0] + want + prompts[2][:5]
    again = cached.generate(follow, GREEDY)
    assert again.stats["cached_tokens"] >= len(prompts[0]) + len(want) - 1
    assert again.token_ids == llm.generate(follow, GREEDY).token_ids


def test_an_aborted_yielded_sequence_frees_its_row_and_lane(llm: LLM, prompts: list[list[int]]) -> None:
    engine = Engine(llm.generator, llm.engine().limits, llm.draft_generator)
    engine.add_request("s", prompts[0], LONG, LOOKUP)
    engine.step()  # its lane runs its prompt
    engine.add_request("p", prompts[1], GREEDY)
    while not engine.scheduler.parked:
        engine.step()
    (out,) = engine.abort("s")
    assert out.finish_reason == "abort"
    assert not engine.scheduler.parked and not engine.scheduler.lanes
    plain: list[int] = []
    while engine.has_unfinished():
        plain += [t for out in engine.step() for t in out.token_ids]
    assert plain == llm.generate(prompts[1], GREEDY).token_ids[-len(plain) :]
    assert engine.scheduler.free_rows == engine.limits.max_batch


def test_a_failed_move_into_the_lane_leaves_the_sequence_in_its_row(
    llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(self: BatchState, row: int, state: DecodeState) -> None:
        raise GenerationError("the move failed")

    monkeypatch.setattr(BatchState, "load_row", fails)
    got = mid_move(llm, prompts, monkeypatch)
    monkeypatch.undo()
    assert got["places"] == ["lane", "row"] and got["engine"].scheduler.resumes == 0
    assert got["tokens"] == llm.generate(prompts[0], LONG).token_ids
    assert not got["engine"].scheduler.rows_only and got["engine"].scheduler.free_rows == 4
