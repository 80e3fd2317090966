"""A pool worker's tensor-parallel ranks as Ray actors.

A worker at ``tensor_parallel_size`` N is N ranks (``engine.ranks``): the worker's own actor
is rank 0 (the engine, its scheduler and blocks), and ranks 1..N-1 are ``RankActor``s that
each hold their shard of the model and of the KV cache and follow rank 0's steps. The pools
give such a worker one placement group of N bundles on one node (``STRICT_PACK``): rank 0 in
bundle 0, rank r in bundle r, each with the worker's CPUs and, on GPUs, one GPU.

A worker's ranks, started by its own actor (``RayRankGroup.start``, before its engine)::

    rank 0 hosts a TCPStore on its node's address ─▶ creates the rank actors (it owns them:
    they die with it) and calls ``run`` on each ─▶ each checks in at the store ─▶ the group
    (shared memory on CPUs, NCCL on GPUs) ─▶ each loads its shard and follows rank 0
    (``RankLoop``) ─▶ ``Stop``, or killed

Failures: a rank is never replaced alone. A rank that dies or raises fails rank 0's next
step (``RankFailure``), and a rank that ends while the worker idles is seen at once (a thread
waits on the ranks' ``run`` calls); either way the worker's process ends (``end_worker``),
so Ray reports the worker dead to every caller: its other ranks die with it, the routers
move or re-run its requests as from any dead worker, and the pools' health thread replaces
it whole, in its placement group, with a new rank group.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.model.model_registry import resolve_model
from engine.ranks import (
    COLLECTIVE_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    RankFailure,
    RankLoop,
    TensorParallel,
    make_group,
)
from kv_transfer import make_backend
from kv_transfer.base import TransferError, TransferMeta
from kv_transfer.checksum import block_checksums
from kv_transfer.collective_channels import advertised_host
from kv_transfer.config import TransferConfig
from kv_transfer.nixl import STUCK_GRACE_S
from kv_transfer.sharded import Heads

log = logging.getLogger(__name__)

RANK_FAILURE_EXIT = 70  # the exit status of a worker whose ranks failed (EX_SOFTWARE)
NOTIFICATIONS_EVERY_S = 1.0  # how often a rank's agent drops the notifications of reads of its blocks
RANK_THREADS = 64  # a rank actor's threads: one follows the steps, the rest serve transfers' reads and sums


def _checked_in(rank: int) -> str:
    return f"ranks/checked-in/{rank}"


class RankActor:
    """Rank ``r`` > 0 of one worker: ``run`` joins rank 0's group and follows it until ``Stop``.

    The rank is also its worker's transfer endpoint for its heads (``kv_transfer.sharded``):
    rank 0 calls ``attach_transfer`` once, then ``pull_heads`` and ``checksums`` for each
    transfer, on the actor's other threads while ``run`` follows the steps (the reads write
    only into blocks reserved for them, which no step touches)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)  # the ranks meet at every collective: more threads only wait
        self.loop: RankLoop | None = None
        self._loop_made = threading.Event()
        self.backend = None

    def run(self, rank: int, size: int, store_host: str, store_port: int, config: EngineConfig) -> int:
        """Check in at rank 0's store, join the group, load this rank's shard and follow rank 0
        until it sends ``Stop``; returns the steps run. Its error, if any, is rank 0's to report."""
        from torch.distributed import TCPStore

        store = TCPStore(store_host, store_port, size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        store.set(_checked_in(rank), "1")
        # Rank 0 gone, Ray ends this actor (its owner): the group's wait needs no check of its own.
        # On GPUs Ray shows each rank actor its own GPU only: config.device is that one.
        group = make_group(store, rank, size, config.device, IDLE_TIMEOUT_S, lambda: True)
        self.loop = RankLoop(config, group, config.device)
        self._loop_made.set()
        return self.loop.run()

    def attach_transfer(self, transfer: TransferConfig) -> Any:
        """Register this rank's KV cache with a backend of ``transfer``'s kind (once the cache
        is allocated) and return its offer with no blocks; None where the backend cannot
        offer a rank's share (only nixl reads one in place)."""
        if not (self._loop_made.wait(START_TIMEOUT_S) and self.loop is not None
                and self.loop.allocated.wait(START_TIMEOUT_S)):
            raise RuntimeError("this rank's KV cache was not allocated in time")
        backend = make_backend(transfer.backend)
        if not hasattr(backend, "offer"):
            return None
        backend.attach_cache(*self.loop.kv_tensors())
        self.backend = backend
        threading.Thread(target=self._drain, args=(backend,), name="kv-notifications", daemon=True).start()
        return backend.offer()

    @staticmethod
    def _drain(backend) -> None:
        """Take the notifications readers leave with this rank's agent (one a read of its
        blocks), which nothing else here asks for, so they do not pile up."""
        while True:
            time.sleep(NOTIFICATIONS_EVERY_S)
            backend.reads_confirmed()

    def pull_heads(self, meta: TransferMeta, reads: list[tuple[Any, Heads, Heads]],
                   block_ids: list[int]) -> tuple[str, str] | None:
        """Read each (payload, src, dst) into ``block_ids``; None, or the failure's (reason, message)."""
        try:
            for payload, src, dst in reads:
                self.backend.pull_heads(meta, payload, block_ids, src, dst)
        except TransferError as e:
            return e.reason, str(e)
        return None

    def checksums(self, block_ids: list[int], heads: tuple[int, int]) -> tuple[int, ...]:
        """This rank's sums of ``block_ids`` (``heads``: its first KV head and the model's count)."""
        return block_checksums(*self.loop.kv_tensors(), block_ids, heads)

    def transfer_stats(self) -> dict[str, Any]:
        return self.backend.stats.as_dict() if self.backend is not None else {}


class RayRankPeer:
    """A rank actor as rank 0's transfers see it (``kv_transfer.sharded.RankPeer``)."""

    def __init__(self, actor, rank: int, transfer: TransferConfig) -> None:
        self.actor, self.rank, self.transfer = actor, rank, transfer

    def offer(self) -> Any:
        # Its future rather than ray.get, which warns in an asyncio actor (the worker's, starting).
        return self.actor.attach_transfer.remote(self.transfer).future().result(timeout=2 * START_TIMEOUT_S)

    async def pull_heads(self, meta: TransferMeta, reads: list[tuple[Any, Heads, Heads]], block_ids: list[int]) -> None:
        """The rank's reads, waited for until they end: past the deadline by ``STUCK_GRACE_S``
        a read is "stuck" (its blocks wait until the call returns: the error's ``settled``)."""
        call = asyncio.wrap_future(self.actor.pull_heads.remote(meta, reads, block_ids).future())
        timeout = max(meta.time_left(), 0.0) + STUCK_GRACE_S if meta.deadline else None
        try:
            failure = await asyncio.wait_for(asyncio.shield(call), timeout=timeout)
        except asyncio.TimeoutError:
            error = TransferError("stuck", f"transfer {meta.transfer_id}: rank {self.rank}'s read is stuck "
                                           "past its deadline")
            error.settled = call  # type: ignore[attr-defined]
            raise error from None
        except RayActorError as e:
            raise TransferError("rank_lost", f"transfer {meta.transfer_id}: rank {self.rank} is gone ({e})") from e
        if failure is not None:
            raise TransferError(*failure)

    async def checksums(self, block_ids: list[int], heads: tuple[int, int]) -> tuple[int, ...]:
        sums: tuple[int, ...] = await self.actor.checksums.remote(block_ids, heads)
        return sums

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await self.actor.transfer_stats.remote()
        return stats


def end_worker(reason: str) -> None:
    """End this worker's process now: its ranks are out of step, and no request it holds can
    go on here. Nothing is handed back first on purpose: to the routers the worker is dead,
    so they move its streams or re-run its requests (an error sent now would end them)."""
    log.error("tensor-parallel ranks failed, ending this worker: %s", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(RANK_FAILURE_EXIT)


class RayRanks:
    """Ranks 1..N-1 as Ray actors (``engine.ranks.RankProcesses``): what went wrong is read
    from their ``run`` calls, and ``stop`` kills them. While not stopped, a thread waits on
    those calls: one that ends (the rank died, raised or returned) calls ``on_failure``."""

    def __init__(self, actors: list, runs: list, on_failure: Callable[[str], None] = end_worker,
                 store=None) -> None:
        self.actors, self.runs = actors, runs
        self.store = store  # the ranks' rendezvous (rank 0 hosts it): kept as long as they run
        self.on_failure = on_failure
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True)

    def watch(self) -> None:
        """Start watching the ranks (once the group is built)."""
        self._watcher.start()

    def _watch(self) -> None:
        ray.wait(self.runs, num_returns=1)
        if not self._stopping.is_set():
            self.on_failure(self.failure(wait_s=0) or "a rank ended")

    def alive(self) -> bool:
        """Whether every rank's ``run`` is still going."""
        return not ray.wait(self.runs, num_returns=1, timeout=0)[0]

    def failure(self, wait_s: float = 2.0) -> str:
        """What is known of ranks whose ``run`` ended; waits up to ``wait_s`` for one to end
        (a rank whose peer just saw it fail may still be going down)."""
        ended, _ = ray.wait(self.runs, num_returns=1, timeout=wait_s)
        if not ended:
            return ""
        ended, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        notes = []
        for rank, run in enumerate(self.runs, start=1):
            if run in ended:
                notes.append(f"rank {rank}: {_outcome(run)}")
        return "; ".join(notes)

    def stop(self, graceful: bool) -> None:
        """End the ranks: after ``Stop`` wait for their ``run`` calls to return, then kill the actors."""
        self._stopping.set()
        if graceful:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def _outcome(run) -> str:
    """How a rank's ended ``run`` call ended, in words."""
    try:
        # Its future rather than ray.get, which warns in an asyncio actor even off its event loop.
        steps = run.future().result(timeout=STOP_TIMEOUT_S)
    except RayActorError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"its actor died ({type(e).__name__}: {first})"
    except Exception as e:  # the rank's own error (a RayTaskError carries its traceback)
        lines = str(e).strip().splitlines()
        return f"raised {lines[-1] if lines else type(e).__name__}"
    return f"returned after {steps} steps"


class WorkerTensorParallel(TensorParallel):
    """Rank 0's side in a worker actor: a step that fails ends the worker (``on_failure``)
    before the engine fails its requests one by one (the routers move them instead)."""

    def __init__(self, group, processes: RayRanks, on_failure: Callable[[str], None] = end_worker) -> None:
        super().__init__(group, processes)
        self.on_failure = on_failure

    def execute(self, runner, step):
        try:
            return super().execute(runner, step)
        except RankFailure as e:
            self.on_failure(str(e))
            raise

    def transfer_peers(self, transfer: TransferConfig) -> list[RayRankPeer]:
        """Ranks 1..N-1 as the worker's transfers see them (``kv_transfer.sharded``)."""
        return [RayRankPeer(actor, rank, transfer) for rank, actor in enumerate(self.processes.actors, start=1)]


@dataclass(frozen=True)
class RayRankGroup:
    """How a worker at ``size`` ranks starts ranks 1..N-1 (the pools pass it to the worker's
    actor, which calls ``start``): rank r in bundle ``first_bundle + r`` of
    ``placement_group``, asking ``num_cpus`` and ``num_gpus``, named ``{name}-rank-{r}``."""

    size: int
    placement_group: object
    first_bundle: int = 0
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    name: str = "tandem-worker"

    def start(self, config: EngineConfig, on_failure: Callable[[str], None] = end_worker) -> TensorParallel:
        """Start the ranks (the module docstring's order) and build rank 0's side of their
        group; returns it for ``LLMEngine(tensor_parallel=...)``. A rank that fails first,
        or a start past ``START_TIMEOUT_S``, raises ``RankFailure`` with the ranks killed."""
        from torch.distributed import TCPStore

        if config.tensor_parallel_size != self.size:
            raise ValueError(f"the engine's tensor_parallel_size is {config.tensor_parallel_size}, "
                             f"the rank group's {self.size}")
        # The ranks load the checkpoint rank 0 resolved (a named model is fetched once).
        config = replace(config, model=str(resolve_model(config.model).path))
        host = advertised_host()
        store = TCPStore(host, 0, self.size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                         wait_for_workers=False)
        actors = [self._actor(rank) for rank in range(1, self.size)]
        runs = [a.run.remote(rank, self.size, host, store.port, config) for rank, a in enumerate(actors, start=1)]
        ranks = RayRanks(actors, runs, on_failure, store)
        try:
            _wait_checked_in(store, ranks, self.size)
            group = make_group(store, 0, self.size, config.device, COLLECTIVE_TIMEOUT_S, ranks.alive)
        except BaseException:
            ranks.stop(graceful=False)
            raise
        ranks.watch()
        return WorkerTensorParallel(group, ranks, on_failure)

    def _actor(self, rank: int):
        return (
            ray.remote(RankActor)
            .options(
                name=f"{self.name}-rank-{rank}",
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                max_restarts=0,
                max_concurrency=RANK_THREADS,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=self.first_bundle + rank,
                ),
            )
            .remote()
        )


def _wait_checked_in(store, ranks: RayRanks, size: int) -> None:
    """Until every rank has checked in; a rank that ends first, or the deadline, raises."""
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = list(range(1, size))
    while waiting:
        waiting = [r for r in waiting if not store.check([_checked_in(r)])]
        if failed := ranks.failure(wait_s=0):
            raise RankFailure(f"a tensor-parallel rank failed to start: {failed}")
        if waiting and time.monotonic() > deadline:
            raise RankFailure(f"tensor-parallel ranks {waiting} did not start within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
