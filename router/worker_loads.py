"""The router's picture of each worker, and the placements made from it: ``WorkerLoads``.

Pure: no asyncio, no Ray, no clock (time comes in as ``now``); workers are anything with a
``worker_id``, a ``key`` (the incarnation: a replacement reuses the id, not the key) and a
``draining`` flag, as ``engine.wire.messages.WorkerRef``. The dispatcher (``router.dispatch``)
keeps one and calls it around its Ray calls; the choices themselves are
``router.placement``'s policies.

What it keeps, per worker:

- its latest load report and when it came (``note``). A report is dropped (``forget``) when
  the worker dies, hangs or refuses a placement as stale: nothing is placed on a worker
  without one until it reports again. ``stale`` lists the workers to ask.
- what was placed there that its report may not show yet: KV blocks on a decode worker,
  prompt tokens on a prefill worker (``pending_blocks``, ``pending_tokens``).
- the prompt blocks it was sent lately (``PrefixIndex``: prefill workers by id, decode
  workers by key), a guess at its prefix cache.
- a tie-break counter per pool, so ties rotate over the workers.

A placement's pending count::

    choose_decode (+blocks) ─▶ decode_answered (−blocks: its reports count them now)
    choose_prefill (+tokens) ─▶ prefill_ended (−tokens: done, failed or refused)

Beyond affinities, a request goes to the decode worker that was last sent its prompt's
leading blocks (its prefix cache likely holds them: colocated, they are not computed again;
disaggregated, they are not sent again) unless that worker is much busier, and likewise to
the prefill worker. Requests that share a prompt (the choices of a request with ``n`` > 1)
share an ``Affinity``: the first one placed records its workers, and the others go to the
same ones while those have room.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

from engine.core.block_hash import BlockHash
from router.dispatch_config import DispatchConfig
from router.placement import (
    DecodeLoadLike,
    PrefillLoadLike,
    PrefixIndex,
    decode_has_room,
    pick_affine,
    pick_decode,
    pick_prefill,
    prefill_here,
    round_robin,
)


class WorkerLike(Protocol):
    """What placement reads of a worker (``engine.wire.messages.WorkerRef``)."""

    @property
    def worker_id(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def draining(self) -> bool: ...


W = TypeVar("W", bound=WorkerLike)
LoadReport = DecodeLoadLike | PrefillLoadLike  # which one: by the pool the worker is listed in


@dataclass
class Affinity:
    """Where requests sharing a prompt go: the workers of the first one placed."""

    decode: str | None = None  # worker key: colocated, the decode worker holds the prompt's blocks
    prefill: str | None = None  # worker id: disaggregated, the prefill worker does


class WorkerLoads:
    """Load reports, pending placements and prefix indexes of both pools; the module docstring
    says what each is for. ``config``: the placement policy, its limits, block size and cap."""

    def __init__(self, config: DispatchConfig) -> None:
        self.config = config
        self._reports: dict[str, LoadReport] = {}  # worker id -> its latest load report
        self._report_times: dict[str, float] = {}  # worker id -> ``now`` when it came
        self._pending_blocks: dict[str, int] = {}  # decode worker id -> blocks placed, not yet answered
        self._blocks_pending = 0  # their sum over every decode worker
        self._pending_tokens: dict[str, int] = {}  # prefill worker id -> prompt tokens placed, not yet done
        self.prefill_prefixes = PrefixIndex()  # by worker id
        self.decode_prefixes = PrefixIndex()  # by key
        self._decode_ties = itertools.count()  # separate counters, so ties rotate within each pool
        self._prefill_ties = itertools.count()

    # -- load reports ----------------------------------------------------------

    def note(self, worker_id: str, load: LoadReport, now: float) -> None:
        """The worker reported ``load`` at ``now``."""
        self._reports[worker_id] = load
        self._report_times[worker_id] = now

    def forget(self, worker_id: str) -> None:
        """Drop the worker's report: nothing is placed there until it reports again."""
        self._reports.pop(worker_id, None)
        self._report_times.pop(worker_id, None)

    def reports(self) -> dict[str, LoadReport]:
        """Each reporting worker's latest report, by worker id (a copy)."""
        return dict(self._reports)

    def stale(self, workers: Iterable[W], now: float) -> list[W]:
        """The workers whose report is older than ``load_poll_s`` at ``now``, or who have none."""
        limit = self.config.load_poll_s
        return [w for w in workers if now - self._report_times.get(w.worker_id, -math.inf) > limit]

    def decode_gone(self, worker: WorkerLike) -> None:
        """The decode worker died: forget its report and what its prefix cache held."""
        self.forget(worker.worker_id)
        self.decode_prefixes.forget(worker.key)

    def prefill_gone(self, worker_id: str) -> None:
        """The prefill worker died or broke: forget its report and what its prefix cache held."""
        self.forget(worker_id)
        self.prefill_prefixes.forget(worker_id)

    # -- placements ------------------------------------------------------------

    def pending_blocks(self, worker_id: str) -> int:
        """KV blocks placed on the decode worker that it has not answered for yet."""
        return self._pending_blocks.get(worker_id, 0)

    def pending_tokens(self, worker_id: str) -> int:
        """Prompt tokens placed on the prefill worker whose prefill has not ended yet."""
        return self._pending_tokens.get(worker_id, 0)

    def decode_answered(self, worker_id: str, blocks: int) -> None:
        """The decode worker answered a placement of ``blocks`` (took it or not): from here its
        own reports count it."""
        self._pending_blocks[worker_id] = self.pending_blocks(worker_id) - blocks
        self._blocks_pending -= blocks

    def prefill_ended(self, worker_id: str, tokens: int) -> None:
        """A prefill of ``tokens`` placed on the worker ended (done, failed or refused)."""
        self._pending_tokens[worker_id] = self.pending_tokens(worker_id) - tokens

    def choose_decode(
        self, workers: Sequence[W], blocks: int, exclude: Collection[str] = (), affinity: Affinity | None = None,
        hashes: Sequence[BlockHash] = (),
    ) -> tuple[W, int] | None:
        """A decode worker with room for ``blocks`` among those with a report, neither draining
        nor ``exclude``d (by key), and how many of the prompt's leading blocks it likely caches;
        with an ``affinity``, its worker first. ``hashes``: the prompt's block hashes, to prefer
        a worker whose prefix cache holds its start. Counts ``blocks`` pending there."""
        cfg = self.config
        reports = self._reports
        listed = [w for w in workers if w.worker_id in reports and not w.draining and w.key not in exclude]
        loads = [cast(DecodeLoadLike, reports[w.worker_id]) for w in listed]
        # Nothing pending anywhere (the usual case between placements): no list of zeros.
        pending = [self.pending_blocks(w.worker_id) for w in listed] if self._blocks_pending else []
        i = None
        if affinity is not None or cfg.placement == "round_robin":
            room = [decode_has_room(load, blocks, cfg.max_running_per_decode, pending[j] if pending else 0)
                    for j, load in enumerate(loads)]
            i = None if affinity is None else pick_affine([w.key for w in listed], affinity.decode, room)
            if i is None and cfg.placement == "round_robin":
                i = round_robin(len(listed), next(self._decode_ties), room)
                if i is None:
                    return None
        if i is None:
            cached = [self.decode_prefixes.matched_blocks(w.key, hashes) for w in listed] if hashes else ()
            i = pick_decode(loads, blocks, cfg.max_running_per_decode, pending, next(self._decode_ties), cached,
                            cfg.max_imbalance_requests)
        if i is None:
            return None
        chosen = listed[i]
        if affinity is not None and affinity.decode is None:
            affinity.decode = chosen.key
        self._pending_blocks[chosen.worker_id] = self.pending_blocks(chosen.worker_id) + blocks
        self._blocks_pending += blocks
        held = self.decode_prefixes.matched_blocks(chosen.key, hashes) if hashes else 0
        if hashes:
            self.decode_prefixes.record(chosen.key, hashes)
        return chosen, held

    def choose_prefill(
        self, workers: Sequence[W], tokens: int, hashes: Sequence[BlockHash] = (), affinity: Affinity | None = None,
        exclude: Collection[str] = (),
    ) -> W | None:
        """The prefill worker for a prompt of ``tokens`` (``hashes``: its block hashes) among
        those with a report, neither draining nor ``exclude``d (by key); with an ``affinity``,
        its worker first. Counts ``tokens`` pending there."""
        cfg = self.config
        listed = [w for w in workers if w.worker_id in self._reports and not w.draining and w.key not in exclude]
        loads = [cast(PrefillLoadLike, self._reports[w.worker_id]) for w in listed]
        pending = [self.pending_tokens(w.worker_id) for w in listed]
        i = None if affinity is None else pick_affine([w.worker_id for w in listed], affinity.prefill)
        if i is None and cfg.placement == "round_robin":
            i = round_robin(len(listed), next(self._prefill_ties))
        elif i is None:
            cached = [self.prefill_prefixes.matched_blocks(w.worker_id, hashes) * cfg.block_size for w in listed]
            i = pick_prefill(loads, pending, next(self._prefill_ties), cached, cfg.max_imbalance_tokens)
        if i is None:
            return None
        chosen = listed[i]
        if affinity is not None and affinity.prefill is None:
            affinity.prefill = chosen.worker_id
        self._pending_tokens[chosen.worker_id] = pending[i] + tokens
        self.prefill_prefixes.record(chosen.worker_id, hashes)
        return chosen

    def prefill_here(
        self, prefill_workers: Sequence[WorkerLike], prompt_tokens: int, held_blocks: int, decode_id: str,
    ) -> str | None:
        """Why the decode worker ``decode_id`` (just chosen: it has a report) should compute a
        prompt of ``prompt_tokens`` itself, ``held_blocks`` of it likely cached there
        (``placement.prefill_here``), or None; never without prefill workers or with both
        rules off. A prefill worker's queue counts what is pending there."""
        cfg = self.config
        if not (cfg.local_prefill_tokens or cfg.local_prefill_backlog_tokens) or not prefill_workers:
            return None
        queues = [
            cast(PrefillLoadLike, self._reports[w.worker_id]).queued_prefill_tokens + self.pending_tokens(w.worker_id)
            for w in prefill_workers if w.worker_id in self._reports and not w.draining
        ]
        uncached = prompt_tokens - min(held_blocks * cfg.block_size, prompt_tokens)
        return prefill_here(uncached, queues, cast(DecodeLoadLike, self._reports[decode_id]),
                            cfg.local_prefill_tokens, cfg.local_prefill_backlog_tokens)
