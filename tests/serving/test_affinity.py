"""Routing keys and the prefix-affinity choice, on synthetic requests and loads (no Ray needed)."""

from __future__ import annotations

import itertools

import pytest

from onnxgen.serving.affinity import AffinityTable, Choice, RoutingKey, choose, rendezvous, routing_key

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You answer in one word."}


def _turns(first: str, replies: int) -> list[list[dict[str, str]]]:
    """The message lists of successive turns of one conversation."""
    messages = [SYSTEM, {"role": "user", "content": first}]
    turns = [list(messages)]
    for i in range(replies):
        messages += [{"role": "assistant", "content": f"reply {i}"}, {"role": "user", "content": f"more {i}"}]
        turns.append(list(messages))
    return turns


def _completion_key(prompt: str) -> RoutingKey:
    key = routing_key("/v1/completions", {"prompt": prompt})
    assert key is not None
    return key


def _key(messages: list[dict[str, str]]) -> RoutingKey:
    key = routing_key(CHAT, {"messages": messages})
    assert key is not None
    return key


def test_a_later_turn_of_a_conversation_carries_the_digests_of_every_earlier_turn() -> None:
    keys = [_key(m) for m in _turns("What colour is the sky on a clear day?", 3)]
    for earlier, later in itertools.pairwise(keys):
        assert later.prefixes[: len(earlier.prefixes)] == earlier.prefixes
        assert later.anchor == earlier.anchor  # the conversation keeps its anchor
        assert len(later.prefixes) == len(earlier.prefixes) + 2


def test_changing_an_early_message_changes_every_digest_after_it() -> None:
    turn = _turns("What colour is the sky?", 2)[-1]
    edited = [dict(m) for m in turn]
    edited[1]["content"] = "What colour is grass?"
    a, b = _key(turn), _key(edited)
    assert a.prefixes[0] == b.prefixes[0]  # the shared system prompt
    assert not set(a.prefixes[1:]) & set(b.prefixes[1:])
    assert a.anchor != b.anchor


def test_conversations_sharing_a_system_prompt_share_its_digest_but_not_their_anchor() -> None:
    a = _key([SYSTEM, {"role": "user", "content": "one"}])
    b = _key([SYSTEM, {"role": "user", "content": "two"}])
    assert a.prefixes[0] == b.prefixes[0] and a.anchor != b.anchor
    tools = (
        _key([SYSTEM, {"role": "user", "content": "one"}]),
        routing_key(
            CHAT, {"messages": [SYSTEM, {"role": "user", "content": "one"}], "tools": [{"type": "function"}]}
        ),
    )
    assert (
        tools[1] is not None and tools[0].prefixes[0] != tools[1].prefixes[0]
    )  # tools render into the prompt


def test_a_completion_prompt_is_keyed_by_doubling_blocks_shared_with_its_extensions() -> None:
    text = "".join(f"line {i}\n" for i in range(200))  # 1,690 characters
    key = routing_key("/v1/completions", {"prompt": text})
    assert key is not None
    assert key.lengths == (128, 256, 512, 1024) and key.total == len(text)
    longer = routing_key("/v1/completions", {"prompt": text + "and more"})
    assert longer is not None and longer.prefixes == key.prefixes
    other = routing_key("/v1/completions", {"prompt": "X" + text[1:]})
    assert other is not None and not set(other.prefixes) & set(key.prefixes)
    short = routing_key("/v1/completions", {"prompt": "hello"})
    assert short is not None and short.prefixes == () and short.anchor
    ids = routing_key("/v1/completions", {"prompt": list(range(100))})
    batch = routing_key("/v1/completions", {"prompt": [text, "second prompt"]})
    assert ids is not None and ids.prefixes and batch == key


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models", {}),
        (CHAT, {"messages": "not a list"}),
        (CHAT, {"messages": []}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", ["not", "an", "object"]),
    ],
)
def test_requests_with_nothing_to_key_on_get_no_key(path: str, body: object) -> None:
    assert routing_key(path, body) is None


REPLICAS = ["replica-a", "replica-b", "replica-c"]
IDLE = dict.fromkeys(REPLICAS, 0)


def test_the_replica_that_served_the_longest_prefix_is_chosen_and_is_a_hit() -> None:
    table = AffinityTable()
    turns = [_key(m) for m in _turns("Tell me a story about a lighthouse keeper.", 2)]
    first = choose(turns[0], REPLICAS, IDLE, table, slack=4)
    assert first.how == "anchor" and not first.hit and first.replica in REPLICAS
    table.record(turns[0], "replica-b")  # served elsewhere than its anchor, e.g. by the load fallback
    assert choose(turns[1], REPLICAS, IDLE, table, slack=4) == Choice("replica-b", "prefix")
    table.record(turns[1], "replica-c")  # its longest prefix moves on
    second = choose(turns[2], REPLICAS, IDLE, table, slack=4)
    assert second == Choice("replica-c", "prefix") and second.hit
    assert (
        choose(turns[2], ["replica-a", "replica-b"], IDLE, table, slack=4).replica == "replica-b"
    )  # c is gone


def test_a_shared_system_prompt_does_not_pull_new_conversations_however_long() -> None:
    table = AffinityTable()
    long_system = {"role": "system", "content": "x" * 500}
    table.record(_key([long_system, {"role": "user", "content": "first"}]), "replica-a")
    for question in ("hi", "y" * 500):
        new = _key([long_system, {"role": "user", "content": question}])
        assert choose(new, REPLICAS, IDLE, table, slack=4).how == "anchor"
    system_only = _key([long_system])  # nothing of its own: the system prompt is its whole prompt
    assert choose(system_only, REPLICAS, IDLE, table, slack=4) == Choice("replica-a", "prefix")


def test_a_completion_prefix_pulls_only_when_it_covers_half_the_prompt() -> None:
    table = AffinityTable()
    shared = "z" * 256
    table.record(_completion_key(shared), "replica-b")
    assert choose(_completion_key(shared + "q" * 200), REPLICAS, IDLE, table, slack=4) == Choice(
        "replica-b", "prefix"
    )
    assert choose(_completion_key(shared + "q" * 400), REPLICAS, IDLE, table, slack=4).how == "anchor"


def test_a_conversation_keeps_its_replica_when_a_long_reply_makes_its_history_less_than_half() -> None:
    table = AffinityTable()
    first = [SYSTEM, {"role": "user", "content": "Write a long essay."}]
    table.record(_key(first), "replica-b")
    second = _key(
        [*first, {"role": "assistant", "content": "z" * 5000}, {"role": "user", "content": "More."}]
    )
    assert choose(second, REPLICAS, IDLE, table, slack=4) == Choice("replica-b", "prefix")
    # the shared system prompt alone still does not pull it (negative control: same lengths, other question)
    other = [SYSTEM, {"role": "user", "content": "Write a short poem."}]
    table = AffinityTable()
    table.record(_key(other[:1]), "replica-b")
    third = _key([*other, {"role": "assistant", "content": "z" * 5000}, {"role": "user", "content": "More."}])
    assert choose(third, REPLICAS, IDLE, table, slack=4).how == "anchor"


def test_a_replica_reporting_the_prefix_in_its_cache_beats_the_routers_memory() -> None:
    table = AffinityTable()
    turns = [_key(m) for m in _turns("Plan a trip to the mountains for a week.", 1)]
    table.record(turns[0], "replica-a")
    held = {"replica-c": {turns[0].prefixes[-1]}, "replica-b": {"unrelated"}}
    assert choose(turns[1], REPLICAS, IDLE, table, slack=4, held=held) == Choice("replica-c", "held")
    held_shorter = {"replica-c": {turns[0].prefixes[0]}}  # the system prompt alone: a shorter prefix
    assert choose(turns[1], REPLICAS, IDLE, table, slack=4, held=held_shorter) == Choice(
        "replica-a", "prefix"
    )


def test_an_overloaded_preferred_replica_gives_way_to_the_least_loaded() -> None:
    table = AffinityTable()
    turns = [_key(m) for m in _turns("Summarise the plot of a long novel.", 1)]
    table.record(turns[0], "replica-a")
    within = {"replica-a": 6, "replica-b": 2, "replica-c": None}
    beyond = {"replica-a": 7, "replica-b": 2, "replica-c": None}
    assert choose(turns[1], REPLICAS, within, table, slack=4).replica == "replica-a"
    assert choose(turns[1], REPLICAS, beyond, table, slack=4) == Choice(None, "overloaded")
    unknown = {"replica-a": None, "replica-b": 0}  # no load known for the preferred one: keep it
    assert choose(turns[1], REPLICAS, unknown, table, slack=4).replica == "replica-a"
    assert choose(None, REPLICAS, IDLE, table, slack=4) == Choice(None, "unkeyed")


def test_without_a_known_prefix_the_anchor_picks_only_among_the_least_loaded() -> None:
    table = AffinityTable()
    keys = [_key([{"role": "user", "content": f"question {i}"}]) for i in range(40)]
    busy = {"replica-a": 3, "replica-b": 1, "replica-c": 1}
    picks = {choose(k, REPLICAS, busy, table, slack=8).replica for k in keys}
    assert picks == {"replica-b", "replica-c"}  # never the busier one, though within the slack
    assert all(choose(k, REPLICAS, busy, table, slack=8).how == "anchor" for k in keys)
    first = keys[0]
    assert choose(first, REPLICAS, IDLE, table, slack=8).replica == rendezvous(first.anchor, REPLICAS)


def test_anchors_spread_over_replicas_and_only_a_lost_replicas_anchors_move() -> None:
    anchors = [f"conversation-{i}" for i in range(300)]
    before = {a: rendezvous(a, REPLICAS) for a in anchors}
    counts = {r: list(before.values()).count(r) for r in REPLICAS}
    assert all(60 <= n <= 140 for n in counts.values()), counts
    after = {a: rendezvous(a, ["replica-a", "replica-c"]) for a in anchors}
    moved = {a for a in anchors if before[a] != after[a]}
    assert moved == {a for a in anchors if before[a] == "replica-b"}


def test_the_table_forgets_the_least_recently_used_digests_beyond_its_capacity() -> None:
    table = AffinityTable(capacity=4)
    keys = [_key([{"role": "user", "content": f"q{i}"}]) for i in range(6)]
    for i, key in enumerate(keys):
        table.record(key, f"r{i}")
    assert len(table) == 4
    assert table.owner(keys[0].prefixes[0]) is None and table.owner(keys[5].prefixes[0]) == "r5"
    table.record(keys[2], "r2")  # used again: now the most recent
    table.record(_key([{"role": "user", "content": "new"}]), "r9")
    assert table.owner(keys[2].prefixes[0]) == "r2" and table.owner(keys[3].prefixes[0]) is None
    with pytest.raises(ValueError, match="capacity"):
        AffinityTable(0)
