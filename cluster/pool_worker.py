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

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.wire.messages import DecodeLoad, PrefillLoad, PrefillResult, Reservation, StalePlacement
from engine.wire.sampling_params import SamplingParams
from engine.wire.token_channel import ChannelAddress
from kv_transfer import TransferMeta
from kv_transfer.config import TransferConfig
from kv_transfer.worker import WorkerBase
from prefill_worker.worker import PrefillWorker

ROLE_CLASSES: dict[str, type[WorkerBase]] = {"prefill": PrefillWorker, "decode": DecodeWorker}
PLACEMENTS = frozenset({"prefill", "reserve", "submit"})  # refused while the worker drains or switches


class PoolWorker:
    """The actor behind a prefill or decode slot when roles may switch (module docstring).
    ``engine_configs``: each role's engine settings (they may differ only in what an engine
    reset changes, ``EngineConfig.RESETTABLE``); ``decode_options``: ``DecodeWorker``'s own
    keyword arguments."""

    def __init__(
        self, role: str, worker_id: str, engine_configs: dict[str, EngineConfig], transfer: TransferConfig,
        torch_threads: int = 1, **decode_options,
    ) -> None:
        self._configs = engine_configs
        self._threads = torch_threads
        self._decode_options = decode_options
        self.epoch = 0
        self.worker = self._make(role, worker_id, transfer)
        self._settled = asyncio.Event()  # clear while a switch runs
        self._settled.set()
        self._fenced = False  # draining or switching: placements are refused

    def _make(self, role: str, worker_id: str, transfer: TransferConfig, previous: WorkerBase | None = None):
        options = self._decode_options if role == "decode" else {}
        return ROLE_CLASSES[role](worker_id, self._configs[role], transfer, self._threads, previous=previous, **options)

    async def _role_method(self, name: str, epoch: int | None):
        """The current role's method ``name``, once no switch runs; ``StalePlacement``
        when the caller's view of this worker is out of date."""
        await self._settled.wait()
        method = getattr(self.worker, name, None)
        stale = epoch is not None and epoch != self.epoch
        if method is None or stale or (self._fenced and name in PLACEMENTS):
            raise StalePlacement(
                f"worker {self.worker.worker_id} is a {self.worker.role} worker at epoch {self.epoch}"
                f"{' and draining' if self._fenced else ''}; the call {name} was made for epoch {epoch}"
            )
        return method

    async def switch_role(self, role: str, worker_id: str) -> dict:
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
        finally:
            self._settled.set()
        return {**ready, "epoch": self.epoch, "idle": was_idle}

    async def drain(self) -> None:
        """Leaving the pool or switching: placements are refused from now on."""
        self._fenced = True
        await self.worker.drain()

    async def role(self) -> dict:
        """Which role this worker has now, under which id and epoch."""
        return {"role": self.worker.role, "worker_id": self.worker.worker_id, "epoch": self.epoch}

    async def subscribe(self, subscriber: str, epoch: int | None = None):
        """The decode role's ``subscribe`` stream."""
        async for message in (await self._role_method("subscribe", epoch))(subscriber):
            yield message

    # -- the roles' calls: each is the current role's method of that name, refused
    # (``StalePlacement``) when made for another epoch or when the role has none --------

    async def _call(self, name: str, epoch: int | None, *args, **kwargs):
        return await (await self._role_method(name, epoch))(*args, **kwargs)

    async def ready(self, epoch: int | None = None) -> dict:
        """Start the role's step thread; who it is (``WorkerBase.ready``)."""
        return await self._call("ready", epoch)

    async def load(self, epoch: int | None = None) -> PrefillLoad | DecodeLoad:
        """The role's load for placement."""
        return await self._call("load", epoch)

    async def stats(self, epoch: int | None = None) -> dict:
        return await self._call("stats", epoch)

    async def abort(self, request_id: str, epoch: int | None = None) -> None:
        await self._call("abort", epoch, request_id)

    async def abort_request(self, request_id: str, epoch: int | None = None) -> None:
        await self._call("abort_request", epoch, request_id)

    async def set_transfer(self, transfer: TransferConfig, epoch: int | None = None) -> None:
        await self._call("set_transfer", epoch, transfer)

    async def record_steps(self, limit: int, epoch: int | None = None) -> None:
        await self._call("record_steps", epoch, limit)

    async def take_steps(self, epoch: int | None = None) -> list[dict]:
        return await self._call("take_steps", epoch)

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, decode_worker, reservation,
        resume_output: list[int] = (), priority: int = 0, epoch: int | None = None,
    ) -> PrefillResult:
        """``PrefillWorker.prefill``."""
        return await self._call("prefill", epoch, request_id, prompt_token_ids, params, decode_worker, reservation,
                                resume_output, priority)

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber: str,
        resume_output: list[int] = (), priority: int = 0, epoch: int | None = None,
    ) -> Reservation | None:
        """``DecodeWorker.reserve``."""
        return await self._call("reserve", epoch, request_id, prompt_token_ids, params, subscriber, resume_output,
                                priority)

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber: str,
        resume_output: list[int] = (), priority: int = 0, epoch: int | None = None,
    ) -> None:
        """``DecodeWorker.submit``."""
        await self._call("submit", epoch, request_id, prompt_token_ids, params, subscriber, resume_output, priority)

    async def receive_kv(
        self, meta: TransferMeta, payload, first_token: int, first_logprobs=None, num_cached_tokens: int = 0,
        prompt_logprobs=None, epoch: int | None = None,
    ) -> int:
        """``DecodeWorker.receive_kv``."""
        return await self._call("receive_kv", epoch, meta, payload, first_token, first_logprobs, num_cached_tokens,
                                prompt_logprobs)

    async def receive_kv_part(self, meta: TransferMeta, payload, first_block: int, epoch: int | None = None) -> int:
        return await self._call("receive_kv_part", epoch, meta, payload, first_block)

    async def transfer_failed(self, request_id: str, epoch: int | None = None) -> None:
        await self._call("transfer_failed", epoch, request_id)

    async def sender_gone(self, sender: str, epoch: int | None = None) -> None:
        await self._call("sender_gone", epoch, sender)

    async def token_channel(self, epoch: int | None = None) -> ChannelAddress | None:
        return await self._call("token_channel", epoch)
