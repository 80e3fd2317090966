"""The Responses API's stored responses (``store``, the default): what ``GET`` and
``DELETE /v1/responses/{id}`` reach and ``previous_response_id`` continues from.

A replica keeps the latest ``max_stored_responses`` in memory (``router.core.ApiConfig``),
least recently used first out: storing or reading one (a ``GET``, or a request that
continues from it) makes it the most recent. A stored response holds the conversation it
ends as chat messages, sharing the earlier turns' message objects with the response it
continued from, so a long conversation costs its text once. The store is the replica's:
it goes when the replica does.

Lifecycle of an entry: ``put`` once the response finished (a failed one is not stored)
─▶ ``get`` any number of times ─▶ gone by ``delete`` or when pushed out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its object as ``GET`` returns it, and the conversation it
    ends (its input and its output as chat messages, its instructions left out: a
    response that continues from it sends its own)."""

    response: dict
    history: tuple[dict, ...]


class ResponseStore:
    """The latest ``capacity`` responses by id (0: none are kept). Validation reads it on
    the tokenizer threads while the event loop writes it: every call takes a lock."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, stored: StoredResponse) -> None:
        """Keep ``stored`` as the most recent; the least recent goes past the capacity."""
        with self._lock:
            if self.capacity == 0:
                return
            self._entries[rid] = stored
            self._entries.move_to_end(rid)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        """The response ``rid`` (now the most recent), or None when it is not kept."""
        with self._lock:
            stored = self._entries.get(rid)
            if stored is not None:
                self._entries.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; whether it was kept."""
        with self._lock:
            return self._entries.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
