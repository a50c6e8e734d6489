"""The bounded in-memory store of finished responses, behind ``previous_response_id``.

Each entry holds the response object (for retrieval) and the conversation a later request continues
(:func:`onnxgen.api.responses_input.conversation`). The store keeps at most ``max_items`` entries and
``max_bytes`` of their JSON size; the least recently used go first. An entry larger than ``max_bytes``
on its own is not kept. Safe to use from several threads.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]
    size: int = field(default=0, compare=False)


def entry_size(response: dict[str, Any], messages: list[dict[str, Any]]) -> int:
    """The bytes an entry is counted for: its JSON size."""
    return len(json.dumps([response, messages], ensure_ascii=False).encode("utf-8"))


class ResponseStore:
    """LRU by count and by bytes (see the module docstring)."""

    def __init__(self, max_items: int = 1024, max_bytes: int = 256 << 20) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError(f"a response store needs room: max_items={max_items}, max_bytes={max_bytes}")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep an entry (replacing one of the same id); False when it alone exceeds ``max_bytes``."""
        size = entry_size(response, messages)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self.bytes -= old.size
            self._entries[response_id] = StoredResponse(response, messages, size)
            self.bytes += size
            while len(self._entries) > self.max_items or self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None when unknown or evicted."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self.bytes -= entry.size
            return entry is not None
