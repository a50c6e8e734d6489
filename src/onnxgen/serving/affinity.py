"""Prefix-aware routing: which replica should serve a prompt so that it finds its prefix there.

A request is keyed by digests of its prompt's leading parts (:func:`routing_key`): for a chat request
one digest per message, each chained on the ones before (so turn 3 of a conversation carries turn 2's
digests, and conversations sharing a system prompt share its digest); for a completion, digests of the
prompt's first 128, 256, 512, ... characters. The ingress computes the key from the JSON body alone
(no tokenizer), and the router (:func:`choose`) sends the request to, in order:

1. a replica that reports holding the longest of those prefixes in its prefix cache (``held``: the
   replica-side signal, from each replica's routing stats), else the replica that served the longest
   of them before (:class:`AffinityTable`, the router's memory), where that prefix reaches into the
   conversation's own messages (chat: a shared system prompt alone does not pull every new conversation
   onto one replica, however long it is) or covers at least half the prompt (completions);
2. when that replica has more than ``slack`` requests in flight beyond the least loaded one, or no
   prefix is known, the least loaded replica: among several, the one the conversation's *anchor* (its
   digest through the first non-system message) hashes to (rendezvous hashing, so ingress replicas
   tend to agree without sharing state, and only a lost replica's conversations move).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FIRST_BLOCK_CHARS = (
    128  # a completion prompt's first digest covers this many characters, the next twice as many...
)
RECORDED_PREFIXES = 64  # digests a request leaves in the router's table (its longest ones)
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class RoutingKey:
    """Digests of a prompt's leading parts (shortest first), how many characters each covers, the
    prompt's length in those characters, the digest of the conversation it belongs to, and (chat) the
    index of the first digest that covers a message of the conversation's own (past the system ones)."""

    prefixes: tuple[str, ...]
    lengths: tuple[int, ...]
    total: int
    anchor: str
    own_from: int | None = None


def _chain(previous: bytes, part: str) -> bytes:
    return hashlib.blake2b(previous + part.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _chat_key(body: Mapping[str, Any]) -> RoutingKey | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    tools = body.get("tools")
    digest = _chain(b"chat", json.dumps(tools, sort_keys=True, ensure_ascii=False) if tools else "")
    prefixes, lengths, anchor, own_from, total = [], [], None, None, 0
    for message in messages:
        text = json.dumps(message, sort_keys=True, ensure_ascii=False)
        digest = _chain(digest, text)
        total += len(text)
        prefixes.append(digest.hex())
        lengths.append(total)
        if anchor is None and not (isinstance(message, dict) and message.get("role") in SYSTEM_ROLES):
            anchor, own_from = prefixes[-1], len(prefixes) - 1
    return RoutingKey(tuple(prefixes), tuple(lengths), total, anchor or prefixes[-1], own_from)


def _text_key(text: str) -> RoutingKey:
    prefixes, lengths, digest, start, end = [], [], b"text", 0, FIRST_BLOCK_CHARS
    while end <= len(text):
        digest = _chain(digest, text[start:end])
        prefixes.append(digest.hex())
        lengths.append(end)
        start, end = end, 2 * end
    anchor = prefixes[0] if prefixes else _chain(b"short", text).hex()
    return RoutingKey(tuple(prefixes), tuple(lengths), len(text), anchor)


def _completion_key(body: Mapping[str, Any]) -> RoutingKey | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        prompt = ",".join(map(str, prompt))  # token ids
    return _text_key(prompt) if isinstance(prompt, str) and prompt else None


def routing_key(path: str, body: Any) -> RoutingKey | None:
    """The key of a request to ``path`` with the parsed JSON ``body``; None where there is nothing to
    key on (another route, or a body the replica will refuse with the precise error)."""
    if not isinstance(body, dict):
        return None
    if path == "/v1/chat/completions":
        return _chat_key(body)
    if path == "/v1/completions":
        return _completion_key(body)
    return None


class AffinityTable:
    """Which replica last served each prefix digest; at most ``capacity`` digests, least recently used
    forgotten first (so no client can grow it without bound)."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, digest: str) -> str | None:
        return self._owners.get(digest)

    def record(self, key: RoutingKey, replica: str) -> None:
        for digest in key.prefixes[-RECORDED_PREFIXES:]:
            self._owners[digest] = replica
            self._owners.move_to_end(digest)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)


@dataclass(frozen=True)
class Choice:
    """The replica to try first (None: the least loaded) and why: ``held`` (it reports holding the
    longest prefix), ``prefix`` (it served the longest known prefix), ``anchor`` (no known prefix: the
    least loaded replica the conversation hashes to), ``overloaded`` (the replica with the prefix has
    more than ``slack`` requests beyond the least loaded) or ``unkeyed`` (nothing to key on)."""

    replica: str | None
    how: str

    @property
    def hit(self) -> bool:
        """The request goes where its prefix is (or was)."""
        return self.how in ("held", "prefix")


def rendezvous(anchor: str, replicas: Sequence[str]) -> str:
    """The replica ``anchor`` hashes to: the same on every ingress, and only the anchors of a replica
    that leaves move."""
    return max(replicas, key=lambda r: hashlib.blake2b(f"{anchor}|{r}".encode(), digest_size=8).digest())


def _longest(
    key: RoutingKey,
    replicas: Sequence[str],
    table: AffinityTable,
    held: Mapping[str, Collection[str]],
    loads: Mapping[str, int | None],
    min_match: float,
) -> Choice | None:
    for index in reversed(range(len(key.prefixes))):
        if key.own_from is not None:
            if index < key.own_from:
                return None  # shared system messages alone do not pull a conversation
        elif key.lengths[index] < min_match * key.total:
            return None
        digest = key.prefixes[index]
        holders = [r for r in replicas if digest in held.get(r, ())]
        if holders:
            return Choice(min(holders, key=lambda r: loads.get(r) or 0), "held")
        owner = table.owner(digest)
        if owner in replicas:
            return Choice(owner, "prefix")
    return None


def choose(
    key: RoutingKey | None,
    replicas: Sequence[str],
    loads: Mapping[str, int | None],
    table: AffinityTable,
    slack: int,
    held: Mapping[str, Collection[str]] | None = None,
    min_match: float = 0.5,
) -> Choice:
    """Where a request with ``key`` should go among ``replicas`` (``loads``: requests in flight on each,
    None where unknown; ``held``: prefix digests each replica reports holding).

    A known prefix counts only where it reaches into the conversation's own messages (chat: a shared
    system prompt alone does not pull every new conversation onto one replica) or, for a prompt without
    such messages, covers at least ``min_match`` of it, and keeps the request on its
    replica while that one has at most ``slack`` requests more than the least loaded. Without a known
    prefix nothing is cached anywhere yet, so the anchor only picks among the least loaded replicas.
    """
    if key is None or not replicas:
        return Choice(None, "unkeyed")
    known = [load for r in replicas if (load := loads.get(r)) is not None]
    least = min(known, default=0)
    found = _longest(key, replicas, table, held or {}, loads, min_match)
    if found is not None:
        load = loads.get(found.replica or "")
        return found if load is None or load - least <= slack else Choice(None, "overloaded")
    idle = [r for r in replicas if (loads.get(r) or 0) <= least]
    return Choice(rendezvous(key.anchor, idle or list(replicas)), "anchor")
