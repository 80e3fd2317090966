"""A pool worker: one Ray actor that serves as a prefill or a decode worker and can
switch between the two without restarting its process or reloading its model.

It holds the worker of its current role (a ``PrefillWorker`` or ``DecodeWorker``) and
forwards each of the roles' calls to it (each declared here, with the role's parameters
and ``epoch``; a test keeps them equal to the roles' public methods). Each role it takes
gets a new epoch (and a new worker id, so no router confuses the loads of its roles); a
router's ``WorkerRef`` carries the epoch it saw, and every placement call (``prefill``,
``reserve``, ``submit``) and load poll says it (``WorkerRef.fence``). A call made by an
older view, a call the current role does not answer, and any placement while the worker
drains or switches are refused with ``StalePlacement`` before anything is done: the router
places the request elsewhere.

A switch (``switch_role``), once the cluster has drained the worker::

    serving role A, epoch n ──drain──▶ draining (placements refused)
        ──switch_role──▶ retire A (streams ended, what is left aborted, step thread stopped)
        ──▶ engine reset (every block free, prefix cache empty, B's scheduler settings)
        ──▶ B ready (its step thread and token channel started) ──▶ serving role B, epoch n+1

Retiring waits for the reads of the old role's blocks that are still in flight (up to the
transfer lease, ``PrefillWorker``): a switch takes at most the drain deadline plus the lease.

The model, the KV cache tensors and the transfer backend (its registered memory and
endpoint) stay. Calls that arrive meanwhile wait for the switch (it takes milliseconds).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.wire.messages import DecodeLoad, PrefillLoad, PrefillResult, Reservation, StalePlacement
from engine.wire.sampling_params import SamplingParams
from engine.wire.token_channel import ChannelAddress
from kv_transfer import TransferMeta
from kv_transfer.config import TransferConfig
from kv_transfer.worker import RankStarter, WorkerBase
from prefill_worker.worker import PrefillWorker

ROLE_CLASSES: dict[str, type[WorkerBase]] = {"prefill": PrefillWorker, "decode": DecodeWorker}
PLACEMENTS = frozenset({"prefill", "reserve", "submit"})  # refused while the worker drains or switches

Role = TypeVar("Role", bound=WorkerBase)


class PoolWorker:
    """The actor behind a prefill or decode slot when roles may switch (module docstring).
    ``engine_configs``: each role's engine settings (they may differ only in what an engine
    reset changes, ``EngineConfig.RESETTABLE``); ``decode_options``: ``DecodeWorker``'s own
    keyword arguments; ``ranks``: what starts its engine's other tensor-parallel ranks (the
    first role's engine only: a switch keeps the engine and its ranks)."""

    def __init__(
        self, role: str, worker_id: str, engine_configs: dict[str, EngineConfig], transfer: TransferConfig, *,
        torch_threads: int = 1, ranks: RankStarter | None = None, **decode_options: Any,
    ) -> None:
        self._configs = engine_configs
        self._threads = torch_threads
        self._ranks = ranks
        self._decode_options = decode_options
        self.epoch = 0
        self.worker = self._make(role, worker_id, transfer)
        self._settled = asyncio.Event()  # clear while a switch runs
        self._settled.set()
        self._fenced = False  # draining or switching: placements are refused
        self._show_role()

    def _make(self, role: str, worker_id: str, transfer: TransferConfig, previous: WorkerBase | None = None
              ) -> WorkerBase:
        options = self._decode_options if role == "decode" else {}
        return ROLE_CLASSES[role](
            worker_id, self._configs[role], transfer, torch_threads=self._threads, previous=previous,
            ranks=self._ranks if previous is None else None, **options)

    def _show_role(self) -> None:
        """Name this process after its role and worker id in ``ps``: ``ray::decode-0:DecodeWorker``
        (Ray's ``<name>:<class>``), not ``ray::PoolWorker`` whatever the role. Between calls Ray
        titles an actor's process ``ray::<the actor's class name>``, read again after each call,
        and the class is this process's own (Ray's subclass of ``PoolWorker``), so the title
        follows from the next call on. In this process without Ray, nothing is renamed."""
        actor_class = type(self)
        if actor_class is not PoolWorker:
            actor_class.__name__ = f"{self.worker.worker_id}:{type(self.worker).__name__}"

    async def _role(self, role: type[Role], call: str, epoch: int | None) -> Role:
        """The current role's worker, once no switch runs, for a call of ``role``'s;
        ``StalePlacement`` when the worker has another role, or the caller's view of it
        is out of date, or it drains and ``call`` is a placement."""
        await self._settled.wait()
        worker = self.worker
        stale = epoch is not None and epoch != self.epoch
        if not isinstance(worker, role) or stale or (self._fenced and call in PLACEMENTS):
            raise StalePlacement(
                f"worker {worker.worker_id} is a {worker.role} worker at epoch {self.epoch}"
                f"{' and draining' if self._fenced else ''}; the call {call} was made for epoch {epoch}"
            )
        return worker

    async def switch_role(self, role: str, worker_id: str) -> dict[str, Any]:
        """Become a ``role`` worker named ``worker_id`` under the next epoch (the cluster
        calls this once the worker is drained). Returns the new role's ``ready`` answer and
        ``idle``: whether the old role ended with nothing left to abort. ``RuntimeError``
        when blocks stay pinned after all (a read in flight): the caller replaces the actor."""
        if role not in ROLE_CLASSES:
            raise ValueError(f"role must be one of {sorted(ROLE_CLASSES)}, got {role!r}")
        if role == self.worker.role:
            raise ValueError(f"worker {self.worker.worker_id} is a {role} worker already")
        await self._settled.wait()
        self._fenced = True
        self._settled.clear()
        try:
            old = self.worker
            was_idle = await old.async_engine.call(old.idle)
            if not await old.retire():
                raise RuntimeError(f"worker {old.worker_id} still holds blocks after retiring; it cannot reset")
            self.worker = self._make(role, worker_id, old.transfer, previous=old)
            self.epoch += 1
            ready = await self.worker.ready()  # its step thread (and token channel) run before any call reaches it
            self._fenced = False
            self._show_role()
        finally:
            self._settled.set()
        return {**ready, "epoch": self.epoch, "idle": was_idle}

    async def drain(self) -> None:
        """Leaving the pool or switching: placements are refused from now on."""
        self._fenced = True
        await self.worker.drain()

    async def role(self) -> dict[str, Any]:
        """Which role this worker has now, under which id and epoch."""
        return {"role": self.worker.role, "worker_id": self.worker.worker_id, "epoch": self.epoch}

    # -- the roles' calls: each goes to the current role's method of that name, refused
    # (``StalePlacement``) when made for another epoch or when the role has none --------

    async def ready(self, *, epoch: int | None = None) -> dict[str, Any]:
        """Start the role's step thread; who it is (``WorkerBase.ready``)."""
        return await (await self._role(WorkerBase, "ready", epoch)).ready()

    async def load(self, *, epoch: int | None = None) -> PrefillLoad | DecodeLoad:
        """The role's load for placement."""
        load: PrefillLoad | DecodeLoad = await (await self._role(WorkerBase, "load", epoch)).load()
        return load

    async def stats(self, *, epoch: int | None = None) -> dict[str, Any]:
        return await (await self._role(WorkerBase, "stats", epoch)).stats()

    async def abort(self, request_id: str, *, epoch: int | None = None) -> None:
        await (await self._role(WorkerBase, "abort", epoch)).abort(request_id)

    async def abort_request(self, request_id: str, *, epoch: int | None = None) -> None:
        await (await self._role(WorkerBase, "abort_request", epoch)).abort_request(request_id)

    async def set_transfer(self, transfer: TransferConfig, *, epoch: int | None = None) -> None:
        await (await self._role(WorkerBase, "set_transfer", epoch)).set_transfer(transfer)

    async def record_steps(self, limit: int, *, epoch: int | None = None) -> None:
        await (await self._role(WorkerBase, "record_steps", epoch)).record_steps(limit)

    async def take_steps(self, *, epoch: int | None = None) -> list[dict[str, Any]]:
        return await (await self._role(WorkerBase, "take_steps", epoch)).take_steps()

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, decode_worker: Any,
        reservation: Reservation, resume_output: Sequence[int] = (), priority: int = 0, epoch: int | None = None,
    ) -> PrefillResult:
        """``PrefillWorker.prefill``."""
        prefill = await self._role(PrefillWorker, "prefill", epoch)
        return await prefill.prefill(request_id, prompt_token_ids, params, decode_worker=decode_worker,
                                     reservation=reservation, resume_output=resume_output, priority=priority)

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0, epoch: int | None = None,
    ) -> Reservation | None:
        """``DecodeWorker.reserve``."""
        decode = await self._role(DecodeWorker, "reserve", epoch)
        return await decode.reserve(request_id, prompt_token_ids, params, subscriber=subscriber,
                                    resume_output=resume_output, priority=priority)

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0, epoch: int | None = None,
    ) -> None:
        """``DecodeWorker.submit``."""
        decode = await self._role(DecodeWorker, "submit", epoch)
        await decode.submit(request_id, prompt_token_ids, params, subscriber=subscriber,
                            resume_output=resume_output, priority=priority)

    async def subscribe(self, subscriber: str, *, epoch: int | None = None) -> AsyncIterator[Any]:
        """``DecodeWorker.subscribe``."""
        async for message in (await self._role(DecodeWorker, "subscribe", epoch)).subscribe(subscriber):
            yield message

    async def receive_kv(
        self, meta: TransferMeta, payload: Any, *, first_token: int, first_logprobs: Any = None,
        num_cached_tokens: int = 0, prompt_logprobs: Any = None, epoch: int | None = None,
    ) -> int:
        """``DecodeWorker.receive_kv``."""
        decode = await self._role(DecodeWorker, "receive_kv", epoch)
        return await decode.receive_kv(meta, payload, first_token=first_token, first_logprobs=first_logprobs,
                                       num_cached_tokens=num_cached_tokens, prompt_logprobs=prompt_logprobs)

    async def receive_kv_part(
        self, meta: TransferMeta, payload: Any, *, first_block: int, epoch: int | None = None,
    ) -> int:
        decode = await self._role(DecodeWorker, "receive_kv_part", epoch)
        return await decode.receive_kv_part(meta, payload, first_block=first_block)

    async def transfer_failed(self, request_id: str, *, epoch: int | None = None) -> None:
        await (await self._role(DecodeWorker, "transfer_failed", epoch)).transfer_failed(request_id)

    async def sender_gone(self, sender: str, *, epoch: int | None = None) -> None:
        await (await self._role(DecodeWorker, "sender_gone", epoch)).sender_gone(sender)

    async def token_channel(self, *, epoch: int | None = None) -> ChannelAddress | None:
        return await (await self._role(DecodeWorker, "token_channel", epoch)).token_channel()
