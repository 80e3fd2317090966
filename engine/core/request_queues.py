"""The scheduler's queues: who waits and who runs, in the order its policy gives.

Pure Python, no torch. Every queue orders requests by one key, the policy's
(``order_key``): the arrival number under ``fcfs``; the priority and then the arrival
under ``priority`` (a lower value is more important, as in vLLM).

- the waiting queue (``waiting_queue(policy)``: ``FcfsQueue`` or ``PriorityQueue``):
  requests to be let in, most important first. A request sent back (preempted by
  recompute, or its remote KV failed) goes to the front under ``fcfs``; under
  ``priority`` it keeps its arrival number, so it goes back to its place.
- ``SortedRequests``: the running and swapped sets, kept sorted by the key. The running
  set's last request is the next preemption victim; the swapped set's first is the
  next to come back.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

from engine.core.request import Request

POLICIES = ("fcfs", "priority")


def order_key(policy: str) -> Callable[[Request], Any]:
    """The sort key of ``policy``: smaller keys are scheduled first and preempted last."""
    if policy == "priority":
        return attrgetter("priority", "seq_no")
    return attrgetter("seq_no")


class FcfsQueue:
    """Arrival order (``fcfs``): a deque; sent-back requests go to its front."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_back_in(self, request: Request) -> None:
        """A request that ran (or was about to) waits again: first in line."""
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)


class PriorityQueue:
    """Most important first (``priority``): a heap of (key, request), keys unique."""

    __slots__ = ("_heap", "_key")

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], Request]] = []
        self._key = order_key("priority")

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request))

    push_back_in = push  # its key still holds its place

    def peek(self) -> Request | None:
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)


WaitingQueue = FcfsQueue | PriorityQueue


def waiting_queue(policy: str) -> WaitingQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()


class SortedRequests:
    """Requests kept sorted by a key (the running set, the swapped set)."""

    __slots__ = ("_key", "_requests")

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    @property
    def in_order(self) -> list[Request]:
        """The requests, first to last (the set's own list: read it, don't change it)."""
        return self._requests

    def first(self) -> Request:
        return self._requests[0]

    def last(self) -> Request:
        return self._requests[-1]

    def add(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=self._key)

    def remove(self, request: Request) -> None:
        i = bisect.bisect_left(self._requests, self._key(request), key=self._key)
        if i == len(self._requests) or self._requests[i] is not request:
            raise ValueError(f"request {request.request_id!r} is not in this set")
        del self._requests[i]
