"""A token-level prefix cache for dense and hybrid decoders: KV rows plus recurrent-state checkpoints.

The index is a radix tree over token ids. Each node owns the KV rows of the tokens on its edge (one array
per past KV tensor, in the graph's layout with batch 1, cut to the edge's positions along the sequence
axis), so a prefix shared by many prompts is stored once. A node may also hold a *checkpoint*: every
recurrent and convolution state after the last token of its edge. A recurrent state cannot be sliced back
to an earlier token the way a KV cache can, so:

- a dense model (no recurrent state) resumes at any token of a cached path: the KV rows up to it;
- a hybrid model resumes at the deepest checkpoint at or before the point where its prompt parts from
  the cached path.

Checkpoints are taken where they are cheap and useful (:meth:`PrefixCache.cuts` says where a prefill
stops to take one): the end of every prompt and the token before it (an exact repeat must still prefill
one token, so that logits exist), every ``checkpoint_interval`` tokens of a long prefill, the point
where the prompt parts from the cached path (the next prompt that shares the same head, e.g. a system
prompt, resumes there), and the end of every reply (the state after the last fed token: the next turn
of a chat resumes there).

Entries are immutable: their arrays are read-only copies, and a restore copies them into the decode
state, so nothing a request does afterwards (decode steps, speculative commits, rewinds) can change a
cached entry. Memory is bounded by a byte budget: every node is sized exactly (its arrays' bytes) and
least recently used leaves are evicted first.

Prompts are partitioned by *scope* (a request's ``cache_salt``, and on the server its API key): each
scope has a tree of its own, so a prefix is found only by requests of the scope that cached it, and no
request can learn from a hit (``cached_tokens``, or its speed) what another scope's prompts held. The
byte budget and the eviction order are shared by all scopes.

Both decode paths use the same three calls: :meth:`PrefixCache.lookup` (the longest usable hit),
:meth:`PrefixCache.restore` (into a reset :class:`~onnxgen.runtime.state.DecodeState`; the server's
batch rows are admitted from such a state) and :meth:`PrefixCache.insert` (from a decode state, or from
arrays such as a batch row's).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnxgen.model.io import DecoderIO
from onnxgen.runtime import memory
from onnxgen.runtime.buffers import dtype_of
from onnxgen.runtime.state import DecodeState

DEFAULT_CHECKPOINT_INTERVAL = 256
MIN_PIECE = 16  # the fewest tokens a prefill piece that ends at a parting-point checkpoint runs
MB = 1 << 20

KVSource = Callable[[int, int], list[np.ndarray]]  # (start, end) -> one copy per past KV tensor


@dataclass(frozen=True)
class CacheCosts:
    """What caching costs for one model: bytes of KV per token, bytes of one state checkpoint."""

    kv_bytes_per_token: int
    state_bytes_per_checkpoint: int


def cache_costs(io: DecoderIO) -> CacheCosts:
    """Bytes one cached token of KV takes (every layer's key and value) and one checkpoint of every
    recurrent / convolution state, for a sequence of batch 1."""
    kv = 0
    for pair in io.kv_pairs:
        shape = pair.buffer_shape(1, 1)
        if pair.layout == "static":  # a static buffer's shape is fixed: one position of it
            shape = tuple(1 if i == pair.seq_axis else d for i, d in enumerate(shape))
        kv += math.prod(shape) * dtype_of(pair.dtype).itemsize * len(pair.inputs)
    state = 0
    for sp in io.state_pairs:
        dims = [1 if i == 0 and not isinstance(d, int) else int(d) for i, d in enumerate(sp.shape)]  # type: ignore[arg-type]
        state += math.prod(dims) * dtype_of(sp.dtype).itemsize
    return CacheCosts(kv, state)


def _frozen(array: np.ndarray) -> np.ndarray:
    """A read-only contiguous copy: entries are never written after they are made."""
    out = np.array(array, copy=True, order="C")
    out.flags.writeable = False
    return out


def _cut(array: np.ndarray, axis: int, start: int, end: int) -> np.ndarray:
    return array[(slice(None),) * axis + (slice(start, end),)]


class _Node:
    """An edge of the radix tree: its tokens, their KV rows, and an optional checkpoint at its end."""

    __slots__ = (
        "checkpoint",
        "children",
        "ckpt_used",
        "end",
        "key",
        "kv",
        "last_used",
        "logits",
        "nbytes",
        "parent",
        "scope",
    )

    def __init__(
        self,
        key: np.ndarray,
        kv: list[np.ndarray],
        parent: _Node | None,
        end: int,
    ) -> None:
        self.key = key  # token ids of the edge (read-only int64)
        self.kv = kv  # per past KV tensor: the edge's positions along its sequence axis
        self.parent = parent
        self.end = end  # tokens from the root to the end of this edge
        self.children: dict[int, _Node] = {}
        self.checkpoint: list[np.ndarray] | None = None  # recurrent states after the edge's last token
        self.logits: np.ndarray | None = None  # the logits after the edge's last token (a prompt's end)
        self.last_used = 0  # the last lookup or insert whose path went through this node
        self.ckpt_used = 0  # when the checkpoint was made or last restored
        self.nbytes = 0
        self.scope: str | None = None  # set on a scope's root
        self.resize()

    def resize(self) -> int:
        """Recount this node's bytes; the change."""
        old = self.nbytes
        self.nbytes = int(self.key.nbytes + sum(a.nbytes for a in self.kv))
        if self.checkpoint is not None:
            self.nbytes += int(sum(a.nbytes for a in self.checkpoint))
        if self.logits is not None:
            self.nbytes += int(self.logits.nbytes)
        return self.nbytes - old


@dataclass(frozen=True)
class Hit:
    """The result of a lookup: resume from ``tokens`` cached tokens (0: a miss).

    ``matched`` is how many leading tokens the prompt shares with the cache (at least ``tokens``): where
    a hybrid's prompt parts from the cached path, a checkpoint there serves the next prompt that parts
    at the same point. ``segments`` holds, per past KV tensor, the cached arrays that make up its first
    ``tokens`` positions; ``states`` the checkpoint to restore (None for a dense model or a miss);
    ``logits`` those after the last token where the hit is the whole prompt (``lookup(whole=True)``)."""

    tokens: int
    matched: int
    segments: tuple[tuple[np.ndarray, ...], ...] = ()
    states: tuple[np.ndarray, ...] | None = None
    logits: np.ndarray | None = None


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made (token counts as vLLM counts them: tokens looked up, tokens hit)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens resumed from the cache (not prefilled)
    lookups: int = 0
    hit_lookups: int = 0
    evictions: int = 0  # nodes evicted
    evicted_bytes: int = 0
    inserts: int = 0
    bytes: int = 0  # in use now
    budget: int = 0
    nodes: int = 0
    checkpoints: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _Walk:
    path: list[tuple[_Node, int]] = field(default_factory=list)  # (node, tokens of its edge matched)
    matched: int = 0


class PrefixCache:
    """The prefix index of one model (see the module docstring). Thread-safe."""

    def __init__(
        self,
        io: DecoderIO,
        budget_bytes: int,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
    ) -> None:
        if budget_bytes < 1:
            raise ValueError(f"the prefix cache budget must be at least 1 byte (got {budget_bytes})")
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1 (got {checkpoint_interval})")
        self.io = io
        self.budget = budget_bytes
        self.checkpoint_interval = checkpoint_interval
        self.hybrid = bool(io.state_pairs)
        self.costs = cache_costs(io)
        self._axes = [p.seq_axis for p in io.kv_pairs for _ in p.inputs]
        self._state_names = [p.input for p in io.state_pairs]
        self._roots: dict[str, _Node] = {}  # by scope; a scope's root goes when its last node does
        self._lock = threading.Lock()
        self._clock = 0
        # least recently used first: (time, tie-break, node, what): what 0 is a leaf (the node and all it
        # holds, time its last_used), 1 the checkpoint of an inner node (time its ckpt_used). An entry is
        # stale once its time moved on, the node left the tree or became a leaf / inner node (skipped when
        # popped). Checkpoints of inner nodes go on their own: a long chat's older checkpoints are inner
        # nodes that its later turns no longer restore.
        self._lru: list[tuple[int, int, _Node, int]] = []
        self._seq = itertools.count()
        self._stats = PrefixCacheStats(budget=budget_bytes)

    @classmethod
    def from_mb(
        cls, io: DecoderIO, mb: float | None, checkpoint_interval: int | None = None
    ) -> PrefixCache | None:
        """A cache of ``mb`` megabytes (MiB; None: :func:`auto_prefix_cache_mb`), or None for 0 (caching
        off); a negative size is an error."""
        if mb is None:
            mb = auto_prefix_cache_mb()
        if mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (got {mb}); 0 turns prefix caching off")
        if mb == 0:
            return None
        return cls(io, max(1, int(mb * MB)), checkpoint_interval or DEFAULT_CHECKPOINT_INTERVAL)

    # -- reading ------------------------------------------------------------------------------------
    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(**self._stats.__dict__)

    def _root(self, scope: str, make: bool = False) -> _Node | None:
        root = self._roots.get(scope)
        if root is None and make:
            root = self._roots[scope] = _Node(np.zeros(0, dtype=np.int64), [], None, 0)
            root.scope = scope
        return root

    def _walk(self, tokens: np.ndarray, scope: str = "") -> _Walk:
        walk, node, pos = _Walk(), self._root(scope), 0
        if node is None:
            return walk
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            key = child.key
            rest = tokens[pos : pos + len(key)]
            same = rest == key[: len(rest)]
            common = len(rest) if same.all() else int(np.argmin(same))
            walk.path.append((child, common))
            pos += common
            if common < len(key):
                break
            node = child
        walk.matched = pos
        return walk

    def lookup(
        self, tokens: Sequence[int] | np.ndarray, count: bool = True, whole: bool = False, scope: str = ""
    ) -> Hit:
        """The longest usable cached prefix of ``tokens``, leaving at least one token to prefill; with
        ``whole``, all of ``tokens`` where they were cached with the logits after them (an exact repeat
        then needs no forward at all).

        ``count``: add the lookup to the query / hit counters (a request's lookup does; a probe does not);
        ``scope``: the partition looked in (module docstring).
        """
        ids = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            walk = self._walk(ids, scope)
            last = walk.path[-1][0] if walk.path else None
            logits = None
            if (
                whole
                and last is not None
                and walk.matched == len(ids) == last.end
                and last.logits is not None
            ):
                logits = last.logits
            limit = len(ids) if logits is not None else min(walk.matched, len(ids) - 1)
            usable, upto = 0, 0  # resume length; path entries it takes
            if self.hybrid:
                for i, (node, common) in enumerate(walk.path):
                    if common == len(node.key) and node.end <= limit and node.checkpoint is not None:
                        usable, upto = node.end, i + 1
            else:
                usable, upto = limit, len(walk.path)
            hit = Hit(0, walk.matched)
            if usable > 0:
                nodes = [node for node, _ in walk.path[:upto]]
                segments = []
                for t in range(len(self._axes)):
                    parts = []
                    for node in nodes:
                        start = node.end - len(node.key)
                        if start >= usable:
                            break
                        part = node.kv[t]
                        if node.end > usable:
                            part = _cut(part, self._axes[t], 0, usable - start)
                        parts.append(part)
                    segments.append(tuple(parts))
                checkpoint = nodes[-1].checkpoint if self.hybrid else None
                states = tuple(checkpoint) if checkpoint is not None else None
                hit = Hit(
                    usable, walk.matched, tuple(segments), states, logits if usable == len(ids) else None
                )
            self._clock += 1
            for node, _ in walk.path:  # the whole shared path is in use
                self._touch(node)
            if hit.states is not None:
                self._use_checkpoint(walk.path[upto - 1][0])
            if count:
                self._stats.lookups += 1
                self._stats.queries += len(ids)
                self._stats.hits += hit.tokens
                self._stats.hit_lookups += hit.tokens > 0
            return hit

    def holds(self, tokens: Sequence[int] | np.ndarray, scope: str = "") -> bool:
        """Whether the state after all of ``tokens`` is cached in ``scope``: their KV rows, and for a
        hybrid a checkpoint after the last one (a probe: no counters, no recency)."""
        ids = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            walk = self._walk(ids, scope)
            if walk.matched < len(ids) or not walk.path:
                return False
            node, common = walk.path[-1]
            return not self.hybrid or (common == len(node.key) and node.checkpoint is not None)

    def restore(self, hit: Hit, state: DecodeState) -> None:
        """Load ``hit`` into ``state`` (an empty decode state, batch 1): its KV rows and checkpoint,
        copied, so the state then holds the first ``hit.tokens`` tokens exactly as they were cached."""
        if hit.tokens == 0:
            return
        states = None
        if self.hybrid:
            assert hit.states is not None
            states = list(hit.states)
        state.load_prefix(hit.tokens, [list(parts) for parts in hit.segments], states)

    def cuts(self, length: int, start: int, matched: int, before_last: bool = True) -> list[int]:
        """Where a prefill of a ``length``-token prompt resumed at ``start`` (with ``matched`` tokens in
        common with the cache) stops to take a checkpoint: ascending positions in ``(start, length]``,
        the last being ``length``. A dense model needs no checkpoint but the end (its KV rows can be cut
        anywhere); a hybrid stops at the parting point, every ``checkpoint_interval`` tokens of a prefill
        longer than that, and (``before_last``) before the last token, where an exact repeat resumes
        unless the prompt's logits are cached with its end (``lookup(whole=True)``)."""
        if not self.hybrid:
            return [length]
        step = self.checkpoint_interval
        marks = {length}
        if before_last and length - 1 > start:
            marks.add(length - 1)
        # (a short piece costs more per token than it saves: no parting point within a few tokens of the
        # resume point, and interval checkpoints only in a prefill longer than an interval)
        if start + min(MIN_PIECE, max(1, step // 2)) <= matched < length:
            marks.add(matched)
        if length - start > step:
            marks.update(range((start // step + 1) * step, length, step))
        return sorted(m for m in marks if m > start)

    # -- writing ------------------------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int] | np.ndarray,
        kv: KVSource,
        states: Sequence[np.ndarray] | None,
        logits: np.ndarray | None = None,
        scope: str = "",
    ) -> None:
        """Cache the prefix ``tokens`` in ``scope``: the KV rows of its positions the cache lacks (``kv(start, end)``
        copies them from wherever they live), for a hybrid the checkpoint ``states`` after its last
        token, and the ``logits`` after it where given (a prompt's end: an exact repeat needs no forward). Least recently used leaves are evicted while the cache is over budget (possibly this very
        prefix, when it alone does not fit)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if len(ids) == 0:
            return
        if self.hybrid and states is None:
            raise ValueError("a hybrid model's prefix needs its recurrent-state checkpoint")
        with self._lock:
            self._clock += 1
            walk = self._walk(ids, scope)
            node = self._root(scope, make=True)
            assert node is not None
            for n, common in walk.path:
                node = self._split(n, common) if common < len(n.key) else n
                self._touch(node)
                if node.end == walk.matched:
                    break
            if walk.matched < len(ids):
                start = walk.matched
                segment = [_frozen(a) for a in kv(start, len(ids))]
                child = _Node(_frozen(ids[start:]), segment, node, len(ids))
                node.children[int(ids[start])] = child
                if node.checkpoint is not None and len(node.children) == 1:  # an inner node now
                    heapq.heappush(self._lru, (node.ckpt_used, next(self._seq), node, 1))
                self._stats.bytes += child.nbytes
                self._stats.nodes += 1
                node = child
            self._touch(node)
            if self.hybrid and node.checkpoint is None and states is not None:
                node.checkpoint = [_frozen(a) for a in states]
                self._use_checkpoint(node)
                self._stats.bytes += node.resize()
                self._stats.checkpoints += 1
            if (
                logits is not None
                and node.logits is None
                and (not self.hybrid or node.checkpoint is not None)
            ):
                node.logits = _frozen(logits)
                self._stats.bytes += node.resize()
            self._stats.inserts += 1
            self._evict()

    def insert_state(
        self,
        tokens: Sequence[int] | np.ndarray,
        state: DecodeState,
        logits: np.ndarray | None = None,
        scope: str = "",
    ) -> None:
        """:meth:`insert` from a batch-1 decode state that has run exactly ``tokens``."""
        if state.length != len(tokens):
            raise ValueError(f"the decode state holds {state.length} tokens, not the {len(tokens)} given")
        states = None
        if self.hybrid:
            arrays = state.state_arrays()
            states = [arrays[name] for name in self._state_names]
        self.insert(tokens, state.kv_slice, states, logits, scope)

    def insert_arrays(
        self,
        tokens: Sequence[int] | np.ndarray,
        kv: dict[str, np.ndarray],
        states: dict[str, np.ndarray],
        scope: str = "",
    ) -> None:
        """:meth:`insert` from one sequence's arrays without the batch axis (a batch row's
        ``row_kv`` / ``row_states``), by input name."""
        names = [n for p in self.io.kv_pairs for n in p.inputs]
        axes = [(p.batch_axis, p.seq_axis) for p in self.io.kv_pairs for _ in p.inputs]

        def source(start: int, end: int) -> list[np.ndarray]:
            out = []
            for name, (batch_axis, seq_axis) in zip(names, axes, strict=True):
                axis = seq_axis - (seq_axis > batch_axis)  # the row arrays have no batch axis
                out.append(np.expand_dims(_cut(kv[name], axis, start, end), batch_axis))
            return out

        checkpoint = [states[n][None] for n in self._state_names] if self.hybrid else None
        self.insert(tokens, source, checkpoint, scope=scope)

    def clear(self) -> None:
        with self._lock:
            self._roots.clear()
            self._lru.clear()
            self._stats.bytes = self._stats.nodes = self._stats.checkpoints = 0

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens: a new parent takes the first ``at`` (and their KV
        rows), ``node`` keeps the rest. Returns the new parent."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        head_kv = [_frozen(_cut(a, ax, 0, at)) for a, ax in zip(node.kv, self._axes, strict=True)]
        head = _Node(_frozen(node.key[:at]), head_kv, parent, node.end - len(node.key) + at)
        head.last_used = node.last_used
        parent.children[int(node.key[0])] = head
        node.kv = [_frozen(_cut(a, ax, at, a.shape[ax])) for a, ax in zip(node.kv, self._axes, strict=True)]
        node.key = _frozen(node.key[at:])
        node.parent = head
        head.children[int(node.key[0])] = node
        self._stats.bytes += head.nbytes + node.resize()
        self._stats.nodes += 1
        return head

    def _touch(self, node: _Node) -> None:
        node.last_used = self._clock
        self._push(node, 0)

    def _use_checkpoint(self, node: _Node) -> None:
        node.ckpt_used = self._clock
        self._push(node, 1)

    def _push(self, node: _Node, what: int) -> None:
        heapq.heappush(self._lru, (node.ckpt_used if what else node.last_used, next(self._seq), node, what))
        if len(self._lru) > 8 * self._stats.nodes + 64:  # stale entries dominate: keep the live ones
            self._lru = [e for e in self._lru if self._live(e)]
            heapq.heapify(self._lru)

    @staticmethod
    def _live(entry: tuple[int, int, _Node, int]) -> bool:
        time, _, node, what = entry
        if node.parent is None:
            return False
        if what == 0:
            return time == node.last_used and not node.children
        return time == node.ckpt_used and node.checkpoint is not None and bool(node.children)

    def _evict(self) -> None:
        """Drop least recently used leaves and inner checkpoints until the cache is within its budget."""
        while self._stats.bytes > self.budget and self._lru:
            entry = heapq.heappop(self._lru)
            if not self._live(entry):
                continue
            node = entry[2]
            if entry[3] == 1:  # an inner node's checkpoint alone (and the logits that go with it)
                node.checkpoint = None
                node.logits = None
                freed = -node.resize()
                self._stats.bytes -= freed
                self._stats.evicted_bytes += freed
                self._stats.checkpoints -= 1
                self._stats.evictions += 1
                continue
            parent = node.parent
            assert parent is not None
            self._drop(node)
            if parent.parent is not None and not parent.children:  # a leaf now: evictable in its turn
                self._push(parent, 0)
            elif parent.parent is None and not parent.children and parent.scope is not None:
                del self._roots[parent.scope]  # an emptied scope

    def _drop(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[int(node.key[0])]
        node.parent = None
        self._stats.bytes -= node.nbytes
        self._stats.evictions += 1
        self._stats.evicted_bytes += node.nbytes
        self._stats.nodes -= 1
        if node.checkpoint is not None:
            self._stats.checkpoints -= 1


def prefill_with_checkpoints(
    cache: PrefixCache,
    state: DecodeState,
    prompt: np.ndarray,
    hit: Hit,
    forward_to: Callable[[int], np.ndarray],
    scope: str = "",
) -> tuple[np.ndarray, int]:
    """Prefill the rest of ``prompt`` after a restored ``hit``, stopping at :meth:`PrefixCache.cuts` to
    cache each prefix (and a hybrid's checkpoint) on the way, and the prompt's last logits with its end
    (so an exact repeat resumes there, with no forward: no checkpoint before the last token is taken).
    ``forward_to(end)`` runs the state's next tokens up to ``end`` and returns the last position's
    logits; the prefixes are cached in ``scope``. Returns those of the last forward (``hit.logits`` for a whole-prompt hit) and the number of
    forwards."""
    if hit.logits is not None and hit.tokens == len(prompt):
        return np.array(hit.logits), 0
    logits: np.ndarray | None = None
    cuts = cache.cuts(len(prompt), hit.tokens, hit.matched, before_last=False)
    for cut in cuts:
        logits = forward_to(cut)
        cache.insert_state(prompt[:cut], state, logits if cut == len(prompt) else None, scope)
    assert logits is not None
    return logits, len(cuts)


# The automatic budget: a share of the memory available when the model loads, capped.
AUTO_PREFIX_CACHE_SHARE = 0.10
AUTO_PREFIX_CACHE_MAX_MB = 1024.0


def auto_prefix_cache_mb() -> float:
    """The prefix cache's budget when none is given: ``AUTO_PREFIX_CACHE_SHARE`` of the memory available
    now, at most ``AUTO_PREFIX_CACHE_MAX_MB`` (that cap where the available memory cannot be read)."""
    available = memory.available_bytes()
    if available is None:
        return AUTO_PREFIX_CACHE_MAX_MB
    return float(min(AUTO_PREFIX_CACHE_MAX_MB, int(available * AUTO_PREFIX_CACHE_SHARE / MB)))
