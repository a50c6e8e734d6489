"""The prefix cache gives the tokens plain decoding gives, and resumes where it should.

Every test compares a model loaded with a prefix cache against the same model loaded without one
(greedy tokens), on dense and hybrid exports (fused LinearAttention and Scan), across KV layouts, and
checks how many prompt tokens were resumed from the cache (``stats["cached_tokens"]``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxgen
from onnxgen import DraftModel, PromptLookup, SamplingParams
from onnxgen.cache.prefix import PrefixCache, cache_costs
from onnxgen.llm import LLM
from onnxgen.testing import build_model

INTERVAL = 8
# (family, kv layout): dense (shared GQA buffer, stacked, static), hybrid fused (shared), Scan (growing),
# hybrid with a static cache
MODELS = [
    ("genai-dense", "split"),
    ("standard-dense", "stacked"),
    ("standard-dense", "static"),
    ("hybrid-genai", "split"),
    ("hybrid-scan", "split"),
    ("hybrid-mobius", "static"),
]
IDS = [f"{f}-{kv}" for f, kv in MODELS]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


SYSTEM = tokens(1, 30)


class Pair:
    """One model loaded twice: plain and with a prefix cache."""

    def __init__(self, model: Path, mb: float = 16) -> None:
        self.plain = onnxgen.load(model, threads=1)
        self.cached = onnxgen.load(model, threads=1, prefix_cache_mb=mb, checkpoint_interval=INTERVAL)

    @property
    def cache(self) -> PrefixCache:
        assert self.cached.prefix_cache is not None
        return self.cached.prefix_cache

    def same(self, prompt: list[int], params: SamplingParams = GREEDY, **kw: object) -> int:
        """Assert both give the same tokens; the cached run's resumed prompt tokens."""
        want = self.plain.generate(prompt, params).token_ids
        got = self.cached.generate(prompt, params, **kw)  # type: ignore[arg-type]
        assert got.token_ids == want
        return int(got.stats["cached_tokens"])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-cache")
    return {f"{f}-{kv}": build_model(root / f"{f}-{kv}", f, kv=kv) for f, kv in MODELS}


@pytest.fixture(scope="module", params=IDS)
def pair(request: pytest.FixtureRequest, dirs: dict[str, Path]) -> Pair:
    return Pair(dirs[request.param])


def test_repeats_shared_system_prompts_and_continuations_decode_as_without_the_cache(pair: Pair) -> None:
    hybrid = pair.cache.hybrid
    first = SYSTEM + tokens(2, 7)
    assert pair.same(first) == 0  # nothing cached yet
    # an exact repeat resumes the whole prompt: its logits were cached with its end, no forward runs
    want = pair.plain.generate(first, GREEDY).token_ids
    again = pair.cached.generate(first, GREEDY)
    assert again.token_ids == want
    assert again.stats["cached_tokens"] == len(first)
    assert again.stats["forward_passes"] == GREEDY.max_new_tokens - 1  # decode steps only
    # another question after the same system prompt: resumes where the prompts part (dense), or at the
    # last checkpoint before it (hybrid: the one every INTERVAL tokens)
    second = SYSTEM + tokens(3, 9)
    parted = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert pair.same(second) == (parted // INTERVAL * INTERVAL if hybrid else parted)
    # a third question resumes at the parting point itself: the second prompt left a checkpoint there
    third = SYSTEM + tokens(4, 5)
    assert pair.same(third) == next(i for i, (a, b) in enumerate(zip(first, third, strict=False)) if a != b)
    # a continuation of the first conversation (its reply, then a new message) resumes after the reply's
    # last fed token
    reply = pair.cached.generate(first, GREEDY).token_ids
    follow = first + reply + tokens(5, 6)
    assert pair.same(follow) == len(first) + len(reply) - 1


def test_a_restored_prefix_is_bit_identical_to_the_state_that_was_saved(pair: Pair) -> None:
    session, cache = pair.cached.session, pair.cache
    prompt = np.asarray(tokens(6, 21), dtype=np.int64)
    state = session.new_state(40)
    session.forward(state, prompt[None], 1)
    saved_kv, saved_states = state.kv_arrays(), state.state_arrays()
    cache.insert_state(prompt, state)
    hit = cache.lookup(np.concatenate([prompt, [7]]), count=False)
    assert hit.tokens == len(prompt)
    fresh = session.new_state(40)
    cache.restore(hit, fresh)
    assert fresh.length == len(prompt)
    for name, array in fresh.kv_arrays().items():
        assert np.array_equal(array, saved_kv[name]), name
    for name, array in fresh.state_arrays().items():
        assert np.array_equal(array, saved_states[name]), name


def test_a_corrupted_cached_entry_changes_the_output(dirs: dict[str, Path]) -> None:
    """Negative control: what is restored is what decides the output (a hybrid's state checkpoint, a
    dense model's KV rows, the cached logits of an exact repeat)."""
    for name in ("hybrid-genai-split", "genai-dense-split"):
        pair = Pair(dirs[name])
        prompt = SYSTEM + tokens(7, 6)
        pair.same(prompt)
        want = pair.plain.generate(prompt, GREEDY).token_ids
        # an exact repeat: its first token comes from the cached logits, the rest from the restored state
        node = pair.cache._walk(np.asarray(prompt)).path[-1][0]
        assert node.end == len(prompt) and node.logits is not None
        logits = node.logits
        node.logits = np.where(np.arange(len(logits)) == want[0], -1e9, logits).astype(logits.dtype)
        got = pair.cached.generate(prompt, GREEDY)
        assert got.stats["cached_tokens"] == len(prompt)
        assert got.token_ids[0] != want[0], name
        node.logits = logits
        if pair.cache.hybrid:
            assert node.checkpoint is not None
            node.checkpoint = [np.full_like(a, 0.5) for a in node.checkpoint]
        else:
            node.kv = [np.full_like(a, 0.5) for a in node.kv]
        got = pair.cached.generate(prompt, GREEDY)
        assert got.stats["cached_tokens"] == len(prompt)
        assert got.token_ids[0] == want[0] and got.token_ids != want, name


def test_entries_are_read_only_copies_that_decoding_and_speculation_leave_alone(pair: Pair) -> None:
    prompt = SYSTEM + tokens(8, 8)
    pair.same(prompt)
    before = [[a.copy() for a in node.kv] for node, _ in pair.cache._walk(np.asarray(prompt)).path]
    spec = PromptLookup(num_draft_tokens=3)
    repeat = prompt + prompt[:12]
    assert pair.same(repeat, speculative=spec) > 0  # verifies and commits run on the restored state
    after = [node.kv for node, _ in pair.cache._walk(np.asarray(prompt)).path]
    flat_before = [a for kv in before for a in kv]
    flat_after = [a for kv in after for a in kv]
    assert sum(a.size for a in flat_before) == sum(a.size for a in flat_after)
    assert np.array_equal(
        np.concatenate([a.ravel() for a in flat_before]), np.concatenate([a.ravel() for a in flat_after])
    )
    assert all(not a.flags.writeable for a in flat_after)


def test_speculative_decoding_after_a_hit_gives_plain_greedy_tokens(dirs: dict[str, Path]) -> None:
    for name in ("hybrid-genai-split", "genai-dense-split"):
        pair = Pair(dirs[name])
        prompt = SYSTEM + tokens(9, 8)
        pair.same(prompt)
        draft = DraftModel(str(dirs[name]), num_draft_tokens=3)
        assert pair.same(prompt, speculative=draft) == len(prompt)  # an exact repeat: the whole prompt
        assert pair.same([*prompt, 5], speculative=draft) == len(prompt)  # one token more to prefill
        assert pair.same(SYSTEM + tokens(10, 4), speculative=PromptLookup(num_draft_tokens=2)) > 0


def test_eviction_keeps_the_cache_within_a_tiny_budget(dirs: dict[str, Path]) -> None:
    model = dirs["hybrid-genai-split"]
    probe = Pair(model)
    costs = cache_costs(probe.cached.io)
    # room for about one prompt of 40 tokens with its checkpoints, not two
    budget_mb = (40 * (costs.kv_bytes_per_token + 8) + 8 * costs.state_bytes_per_checkpoint) / (1 << 20)
    pair = Pair(model, mb=budget_mb)
    prompts = [tokens(20 + i, 36) for i in range(3)]
    for prompt in prompts:
        assert pair.same(prompt) == 0
        s = pair.cache.stats()
        assert 0 < s.bytes <= s.budget
    assert pair.cache.stats().evictions > 0
    assert pair.same(prompts[0]) == 0  # the least recently used went first
    assert pair.same(prompts[0]) == len(prompts[0])  # (cached again just now, with its logits)


def test_entries_are_sized_exactly(dirs: dict[str, Path]) -> None:
    for name in ("genai-dense-split", "hybrid-scan-split"):
        llm = onnxgen.load(dirs[name], threads=1, prefix_cache_mb=16, checkpoint_interval=INTERVAL)
        cache = llm.prefix_cache
        assert cache is not None
        prompt = tokens(30, 19)
        llm.generate(prompt, SamplingParams(max_new_tokens=1))
        s, costs = cache.stats(), cache.costs
        # KV rows and token ids of 19 tokens, the fp32 logits after the last; checkpoints at 8, 16 and 19
        # for the hybrid
        expect = 19 * (costs.kv_bytes_per_token + 8) + s.checkpoints * costs.state_bytes_per_checkpoint
        assert s.bytes == expect + 4 * llm.session.vocab_size
        assert s.checkpoints == (3 if cache.hybrid else 0)


def test_cuts_stop_where_checkpoints_are_taken(dirs: dict[str, Path]) -> None:
    hybrid = onnxgen.load(dirs["hybrid-genai-split"], threads=1, prefix_cache_mb=1, checkpoint_interval=8)
    dense = onnxgen.load(dirs["genai-dense-split"], threads=1, prefix_cache_mb=1, checkpoint_interval=8)
    assert hybrid.prefix_cache is not None and dense.prefix_cache is not None
    assert hybrid.prefix_cache.cuts(30, 0, 0) == [8, 16, 24, 29, 30]
    assert hybrid.prefix_cache.cuts(30, 16, 21) == [21, 24, 29, 30]
    assert dense.prefix_cache.cuts(30, 16, 21) == [30]
    # without the checkpoint before the last token (a prompt cached with its logits)
    assert hybrid.prefix_cache.cuts(30, 16, 21, before_last=False) == [21, 24, 30]


CHAT_TURNS = ["hello there, how are you", "and then what happened?", "tell me one more thing"]


def test_chat_turns_resume_after_the_previous_reply_and_decode_as_without_the_cache(
    dirs: dict[str, Path],
) -> None:
    """Each turn resumes after the previous reply and its end-of-turn tokens, as the template renders them
    (``cache_turn``): only the new message is prefilled, and the greedy tokens are plain decoding's, for
    ``chat`` and ``stream_chat``. Without ``cache_turn`` the same turns resume before the reply: this
    random model's replies do not encode back to the ids it generated."""
    for name in ("hybrid-genai-split", "genai-dense-split", "hybrid-scan-split"):
        pair = Pair(dirs[name])
        off = onnxgen.load(dirs[name], threads=1, prefix_cache_mb=16, checkpoint_interval=INTERVAL)
        tok = pair.cached.tokenizer
        assert tok is not None
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        history: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
        for turn, text in enumerate(CHAT_TURNS):
            history.append({"role": "user", "content": text})
            prompt = pair.cached.chat_prompt(history)
            want = pair.plain.chat(history, params)
            if turn == 1:  # the streamed path closes the turn too (once the last event was taken)
                events = list(pair.cached.stream_chat(history, params))
                ids = [t for e in events for t in e.token_ids]
                got_text = "".join(e.text for e in events)
                stats = events[-1].stats or {}
            else:
                got = pair.cached.chat(history, params)
                ids, got_text, stats = got.token_ids, got.text, got.stats
            base = off.chat(history, params, cache_turn=False)
            assert ids == want.token_ids == base.token_ids, (name, turn)
            assert stats["next_turn_prefill_tokens"] > 0
            if turn:
                # the previous prompt and reply are resumed: what is prefilled is at most this message
                # as a conversation of its own renders it (header, text, end of turn, generation prompt)
                alone = len(pair.cached.chat_prompt([{"role": "user", "content": text}]))
                prefilled = len(prompt) - stats["cached_tokens"]
                assert len(tok.encode(text, add_special_tokens=False)) <= prefilled <= alone, (name, turn)
                # without cache_turn the reply (re-encoded) is prefilled again
                assert len(prompt) - base.stats["cached_tokens"] > prefilled, (name, turn)
            history.append({"role": "assistant", "content": got_text})


def test_a_corrupted_closed_turn_changes_the_next_reply(dirs: dict[str, Path]) -> None:
    """Negative control: the next turn is decoded from the state the closed turn cached (its tokens' KV
    rows, a hybrid's checkpoint): corrupting it changes the reply."""
    from onnxgen.chat.continuation import next_turn_prefix

    for name in ("hybrid-genai-split", "genai-dense-split"):
        pair = Pair(dirs[name])
        tok = pair.cached.tokenizer
        assert tok is not None
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        history = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": CHAT_TURNS[0]},
        ]
        reply = pair.cached.chat(history, params).text
        closed = next_turn_prefix(tok, history, {"role": "assistant", "content": reply})
        assert pair.cache.holds(closed)
        node = pair.cache._walk(np.asarray(closed)).path[-1][0]
        assert node.end == len(closed)
        # (this random hybrid's recurrent states fade over the new message's ~20 tokens: its attention
        # layers' rows of the closed turn are corrupted too)
        noise = np.random.default_rng(0)
        if pair.cache.hybrid:
            assert node.checkpoint is not None
            node.checkpoint = [noise.normal(0, 10, a.shape).astype(a.dtype) for a in node.checkpoint]
        node.kv = [noise.normal(0, 10, a.shape).astype(a.dtype) for a in node.kv]
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": CHAT_TURNS[1]}]
        got = pair.cached.chat(history, params)
        assert got.stats["cached_tokens"] == len(closed)
        assert got.token_ids != pair.plain.chat(history, params).token_ids, name


def test_extend_cache_runs_only_what_is_missing(dirs: dict[str, Path]) -> None:
    for name in ("hybrid-genai-split", "genai-dense-split"):
        pair = Pair(dirs[name])
        prompt = SYSTEM + tokens(11, 9)
        assert pair.cached.generator.extend_cache(prompt) == len(prompt)
        assert pair.cache.holds(prompt)
        assert pair.cached.generator.extend_cache(prompt) == 0  # already cached
        longer = [*prompt, *tokens(12, 5)]
        assert pair.cached.generator.extend_cache(longer) == 5  # resumes at the end of the first
        # what was run is what a plain prefill gives
        assert pair.same([*longer, 9]) == len(longer)


def test_a_budget_of_zero_is_off_and_a_negative_one_is_refused(dirs: dict[str, Path]) -> None:
    llm: LLM = onnxgen.load(dirs["genai-dense-split"], threads=1, prefix_cache_mb=0)
    assert llm.prefix_cache is None
    assert llm.generate(tokens(1, 5), GREEDY).stats["cached_tokens"] == 0
    with pytest.raises(ValueError, match="prefix_cache_mb must be >= 0"):
        onnxgen.load(dirs["genai-dense-split"], threads=1, prefix_cache_mb=-1)


def test_inspect_states_what_a_cached_token_and_a_checkpoint_cost(dirs: dict[str, Path]) -> None:
    from onnxgen.cli.inspect import prefix_cache_summary
    from onnxgen.model.package import ModelPackage

    for name in ("hybrid-mobius-static", "standard-dense-stacked", "hybrid-genai-split"):
        llm = onnxgen.load(dirs[name], threads=1)
        state = llm.session.new_state(4)
        llm.session.forward(state, np.array([[5, 6]]), 1)
        per_token = sum(a.nbytes for a in state.kv_slice(0, 1))  # what one token's rows take in the state
        per_checkpoint = sum(a.nbytes for a in state.state_arrays().values())
        shown = prefix_cache_summary(ModelPackage.open(dirs[name]))
        assert shown["prefix_cache_kv_per_token"].startswith(f"{per_token:,} bytes")
        if per_checkpoint:
            assert shown["prefix_cache_state_checkpoint"].startswith(f"{per_checkpoint:,} bytes")
        else:
            assert "prefix_cache_state_checkpoint" not in shown


def test_least_recently_used_prefixes_go_first_and_a_used_one_stays(dirs: dict[str, Path]) -> None:
    llm = onnxgen.load(dirs["genai-dense-split"], threads=1)
    state = llm.session.new_state(8)
    llm.session.forward(state, np.array([[5, 6, 7]]), 1)
    per_prefix = 3 * (cache_costs(llm.io).kv_bytes_per_token + 8)
    cache = PrefixCache(llm.io, 10 * per_prefix)
    kept = [3, 4, 5]
    cache.insert(kept, state.kv_slice, None)
    for i in range(200):
        cache.insert([10 + i, 11, 12], state.kv_slice, None)
        assert cache.lookup([*kept, 9]).tokens == 3  # used after every insert: never the oldest
        assert cache.stats().bytes <= 10 * per_prefix
    assert cache.lookup([10, 11, 12, 9]).tokens == 0  # the first of the others went long ago
    assert cache.lookup([209, 11, 12, 9]).tokens == 3  # the last one is there
    assert cache.stats().evictions == 201 - 10


def test_the_chat_benchmark_resumes_every_turn_after_the_first(dirs: dict[str, Path]) -> None:
    from onnxgen.bench.prefix import PrefixBenchConfig, PrefixBenchReport, format_prefix_report, run_chat

    cfg = PrefixBenchConfig(str(dirs["hybrid-genai-split"]), 1, turns=3, turn_tokens=20, new_tokens=4, runs=1)
    report = PrefixBenchReport(cfg.model)
    run_chat(cfg, report)
    assert report.chat_cached_tokens[0] == 0
    # every later turn resumes at least the previous turn's prompt
    for turn in (1, 2):
        assert report.chat_cached_tokens[turn] >= report.chat_prompt_tokens[turn - 1] - 1
    assert 0 < report.chat_cache_bytes <= report.cache_budget
    assert "chat hit rate" in format_prefix_report(report)


def test_a_long_conversation_sheds_its_old_checkpoints_and_keeps_its_latest(dirs: dict[str, Path]) -> None:
    """A chat's older checkpoints are inner nodes of its path that later turns no longer restore: over
    budget they go first, not the conversation's end."""
    llm = onnxgen.load(dirs["hybrid-genai-split"], threads=1)
    costs = cache_costs(llm.io)
    cache = PrefixCache(llm.io, 60 * (costs.kv_bytes_per_token + 8) + 2 * costs.state_bytes_per_checkpoint)
    ids = np.asarray(tokens(40, 60))
    state = llm.session.new_state(64)
    for end in range(10, 61, 10):  # six turns, each resuming from the last
        llm.session.forward(state, ids[None, state.length : end], 1)
        cache.insert_state(ids[:end], state)
        assert cache.lookup(np.concatenate([ids[:end], [9]])).tokens == end
        assert cache.stats().bytes <= cache.budget
    s = cache.stats()
    assert s.checkpoints == 2 and s.evictions == 4
    assert cache.lookup(np.concatenate([ids[:35], [9]])).tokens == 0  # the checkpoints before 50 are gone
