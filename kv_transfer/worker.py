"""What every worker actor shares: an engine stepping in its thread, its metrics, and
a transfer backend, with the health and stats methods the cluster calls, and the one
count of failed transfers (``_count_failure``: the backend's stats and the metrics).

At ``tensor_parallel_size`` above one its transfers go through every rank
(``kv_ranks``, ``kv_transfer.sharded``): each rank offers, reads and sums the KV heads it
holds. ``PrefillWorker`` and ``DecodeWorker`` build their roles on top of it. It joins an
engine to a transfer backend, so it sits above ``engine`` and ``kv_transfer`` (neither
knows the other's role in a worker) and below both worker packages.
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import asdict
from typing import Any, Protocol

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.ranks import TensorParallel
from engine.wire.messages import DecodeLoad, KVLayout, PrefillLoad, request_of
from engine.wire.metrics import EngineMetrics
from kv_transfer.base import TransferError
from kv_transfer.config import TransferConfig
from kv_transfer.handoff import HandoffError
from kv_transfer.packed import as_paged, reconfigure
from kv_transfer.sharded import HasRankPeers, KVRanks, RankPeer


def kv_layout(engine: LLMEngine) -> KVLayout:
    """The shape and dtype of one request's KV as this worker's engine holds it."""
    c = engine.model_config
    return KVLayout(
        num_layers=c.num_layers,
        block_size=engine.config.block_size,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=str(engine.kv_tensors()[0].dtype).removeprefix("torch."),
        layer_windows=tuple(c.layer_windows) if any(c.layer_windows) else (),
    )


class RankStarter(Protocol):
    """Starts a worker's tensor-parallel ranks past rank 0 (``cluster.rank_actors.RayRankGroup``:
    Ray actors in the worker's placement group) and returns rank 0's side of their group."""

    def start(self, config: EngineConfig) -> TensorParallel: ...


class WorkerBase:
    """The base of both worker actors: loads the engine, attaches the transfer backend to its cache
    and answers the cluster's health, load, stats, drain and abort calls. Built in a Ray actor
    through a role class; ``ready`` starts the step thread."""

    role = "worker"

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        transfer: TransferConfig,
        *,
        torch_threads: int = 1,
        previous: WorkerBase | None = None,
        ranks: RankStarter | None = None,
    ) -> None:
        """``previous``: the retired worker (``retire``) of another role in this process
        whose model, KV cache and transfer backend this one takes over (a role switch:
        its engine is reset to ``engine_config``, nothing is reloaded, its ranks stay).
        ``ranks``: what starts the engine's other ranks at ``tensor_parallel_size`` > 1
        (None: processes of this host, ``engine.ranks.LocalRanks``)."""
        torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.transfer = transfer
        if previous is None:
            tensor_parallel = ranks.start(engine_config) if ranks is not None else None
            self.engine = LLMEngine(engine_config, tensor_parallel=tensor_parallel)
            # Transfers read and write the paged cache: packed backends through an adapter.
            self.backend = as_paged(transfer.make_backend())
            self.backend.attach_cache(*self.engine.kv_tensors())
            peers: list[RankPeer] = (
                tensor_parallel.transfer_peers(transfer) if isinstance(tensor_parallel, HasRankPeers) else [])
            self.kv_ranks = KVRanks(*self.engine.kv_tensors(), self.engine.model_config.num_kv_heads,
                                    engine_config.tensor_parallel_size, peers)
        else:
            self.engine, self.backend, self.kv_ranks = previous.engine, previous.backend, previous.kv_ranks
            self.engine.reset(engine_config)
        self.metrics = EngineMetrics(self.engine.model_name, self.role, worker_id)
        self.async_engine = AsyncEngine(self.engine, metrics=self.metrics)
        self.layout = kv_layout(self.engine)
        self.draining = False  # leaving its pool (``drain``)

    async def ready(self) -> dict[str, Any]:
        """Start the step thread; answers health checks with who this is."""
        self.async_engine.start()
        return {"worker_id": self.worker_id, "role": self.role, "pid": os.getpid(), "node": socket.gethostname()}

    async def drain(self) -> None:
        """This worker is leaving its pool: it finishes what it has and takes no new
        reservation (a router with an older worker list places elsewhere)."""
        self.draining = True

    def idle(self) -> bool:
        """Step thread (or none running): nothing here holds a request or a block."""
        return not (self.engine.request_ids() or self.engine.held_request_ids()
                    or self.engine.stats().num_blocks_in_use)

    async def retire(self) -> bool:
        """Leave this role, for a worker of another role to take over the engine: end
        the streams out of it (``_let_go``: their readers move on as from a gone worker),
        abort whatever it still holds, and stop the step thread. Returns whether it ended
        idle (False: blocks stay pinned, by a read in flight say, and its engine cannot
        be reset)."""
        await self._let_go()
        await self.async_engine.call(self._abort_everything)
        await self.async_engine.stop()
        return self.idle()

    async def _let_go(self) -> None:
        """On the event loop, as it retires: end what this role keeps outside the engine
        (decode: its subscribers' streams; prefill: its hand-offs)."""

    def _abort_everything(self) -> None:
        """On the step thread, as it retires: abort every request here."""
        for rid in self.engine.request_ids():
            self.abort_now(rid)

    async def set_transfer(self, transfer: TransferConfig) -> None:
        """Take new transfer settings (deadlines, failure policy, injected faults) without
        a restart: drills and chaos tests switch faults on a running service. The backend
        stays; a transfer under way finishes under the settings it started with."""
        self.backend = reconfigure(self.backend, transfer)
        self.transfer = transfer

    def _count_failure(self, failure: BaseException | str) -> str:
        """Count one failed transfer, in the backend's stats and the metrics, by its
        reason, which it returns: ``failure`` itself when it is one, else the error's
        (a transfer or hand-off error's label, "timeout", or the error's type)."""
        if isinstance(failure, str):
            reason = failure
        elif isinstance(failure, (TransferError, HandoffError)):
            reason = failure.reason
        else:
            reason = "timeout" if isinstance(failure, asyncio.TimeoutError) else type(failure).__name__
        self.backend.stats.failures[reason] += 1
        self.metrics.on_transfer_failure(reason)
        return reason

    async def load(self) -> PrefillLoad | DecodeLoad:
        """This worker's load for placement (each role's ``_load``, run on the step thread)."""
        load: PrefillLoad | DecodeLoad = await self.async_engine.call(self._load)
        return load

    def _load(self) -> PrefillLoad | DecodeLoad:
        """On the step thread: this role's load report."""
        raise NotImplementedError(f"a {self.role} worker reports no load")

    async def stats(self) -> dict[str, Any]:
        def engine_stats() -> dict[str, Any]:  # one call on the step thread
            return {**self.engine.stats().__dict__, "held": sorted(self.engine.held_request_ids())}  # for a reader

        stats: dict[str, Any] = await self.async_engine.call(engine_stats)
        stats["transfer"] = self.backend.stats.as_dict()
        if self.kv_ranks.peers:  # every rank's own counters, rank 0's first
            stats["transfer"]["ranks"] = [self.backend.stats.as_dict(), *await self.kv_ranks.stats()]
        return stats

    async def record_steps(self, limit: int) -> None:
        """Keep the latest ``limit`` steps' shapes and times (0: stop): a step profile
        timed inside the serving worker, under its load (``AsyncEngine.record_steps``)."""
        self.async_engine.record_steps(limit)

    async def take_steps(self) -> list[dict[str, Any]]:
        """The steps kept since the last call, as rows of ``StepShape`` fields, ``step_ms``
        (the simulator's profile rows) and ``start_s`` (``time.monotonic()``)."""
        return [{**asdict(shape), "step_ms": 1e3 * seconds, "start_s": start}
                for shape, start, seconds in self.async_engine.take_steps()]

    async def abort(self, request_id: str) -> None:
        """Abort one attempt (the id the router placed it under)."""
        self.async_engine.submit(self.abort_now, request_id)

    async def abort_request(self, request_id: str) -> None:
        """Abort every attempt of the client's ``request_id`` held here (an Abort that
        reached a router replica not running the request)."""
        self.async_engine.submit(self._abort_attempts_of, request_id)

    def _abort_attempts_of(self, request_id: str) -> None:
        for aid in self.engine.request_ids():
            if request_of(aid) == request_id:
                self.abort_now(aid)

    def abort_now(self, request_id: str) -> None:
        """On the step thread: abort one attempt now (each role adds what it holds)."""
        self.async_engine.abort_now(request_id)
