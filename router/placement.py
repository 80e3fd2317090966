"""Placement policies: pure functions of the load reports the workers publish.

No Ray, no torch, no clock: they take plain load records (anything with the fields
below) and return an index into them, or None when no worker can take the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PrefillLoadLike(Protocol):
    queued_prefill_tokens: int


class DecodeLoadLike(Protocol):
    free_blocks: int
    running: int
    waiting: int
    waiting_for_kv: int


def _rotated(n: int, start: int) -> list[int]:
    """Indices from ``start`` on, wrapping: ties go to different workers in turn."""
    return [(start + j) % n for j in range(n)]


def pick_prefill(
    loads: Sequence[PrefillLoadLike], pending: Sequence[int] = (), tie_break: int = 0
) -> int | None:
    """The worker with the fewest queued prefill tokens.

    ``pending``: tokens placed on each worker that its last report may not show yet.
    """
    if not loads:
        return None
    extra = list(pending) + [0] * (len(loads) - len(pending))
    return min(_rotated(len(loads), tie_break), key=lambda i: loads[i].queued_prefill_tokens + extra[i])


def pick_decode(
    loads: Sequence[DecodeLoadLike],
    blocks_needed: int,
    max_running: int,
    pending_blocks: Sequence[int] = (),
    tie_break: int = 0,
) -> int | None:
    """The worker with the most free KV blocks among those under the running cap.

    None when no worker has room for ``blocks_needed`` blocks right now.
    """
    best, best_free = None, -1
    for i in _rotated(len(loads), tie_break):
        load = loads[i]
        free = load.free_blocks - (pending_blocks[i] if i < len(pending_blocks) else 0)
        active = load.running + load.waiting + load.waiting_for_kv
        if free < blocks_needed or active >= max_running:
            continue
        if free > best_free:
            best, best_free = i, free
    return best


def round_robin(num_workers: int, counter: int) -> int | None:
    """The baseline: worker ``counter mod n``."""
    return counter % num_workers if num_workers else None
