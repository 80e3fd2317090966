"""The worker actors' API as the router and the other workers call it: typed ``Protocol``s
that the real worker classes (``prefill_worker.worker.PrefillWorker``,
``decode_worker.worker.DecodeWorker``, and ``cluster.pool_worker.PoolWorker``, which
forwards to either) and every stand-in the tests and benchmarks use are checked against
(``tests/unit/test_worker_api.py``): a call the router makes that a worker lacks, or
whose parameters drifted, fails a test rather than a request.

A call with more than the one or two arguments its name implies takes the rest by
keyword (``reserve(attempt, prompt, params, subscriber=...)``), so that no argument
lands in another's place across a process boundary, where nothing checks types.
Callers go through ``engine.wire.clients``, whose methods repeat these parameters for a
type checker to see past Ray's ``handle.<name>.remote(...)``; the ``epoch`` keyword of a
pool worker's placement calls and load polls (``WorkerRef.fence``) is not part of a
role's own API.

Torch-free, like the rest of what the router imports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from engine.wire.messages import DecodeLoad, PrefillLoad, PrefillResult, Reservation
from engine.wire.sampling_params import SamplingParams
from engine.wire.token_channel import ChannelAddress


@runtime_checkable
class WorkerAPI(Protocol):
    """What the cluster and the router ask of any worker."""

    async def ready(self) -> dict[str, Any]: ...

    async def drain(self) -> None: ...

    async def stats(self) -> dict[str, Any]: ...

    async def abort(self, request_id: str) -> None: ...

    async def abort_request(self, request_id: str) -> None: ...


@runtime_checkable
class PrefillWorkerAPI(WorkerAPI, Protocol):
    """A prefill worker: the router places prompts on it, naming the decode worker (its
    actor handle) that reserved their blocks."""

    async def load(self) -> PrefillLoad: ...

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, decode_worker: Any,
        reservation: Reservation, resume_output: Sequence[int] = (), priority: int = 0,
    ) -> PrefillResult: ...


@runtime_checkable
class DecodeWorkerAPI(WorkerAPI, Protocol):
    """A decode worker: the router reserves, submits and subscribes; prefill workers
    hand it KV (``receive_kv``, ``receive_kv_part``) or tell it none will come."""

    async def load(self) -> DecodeLoad: ...

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0,
    ) -> Reservation | None: ...

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0,
    ) -> None: ...

    def subscribe(self, subscriber: str) -> AsyncIterator[Any]: ...

    async def token_channel(self) -> ChannelAddress | None: ...

    async def receive_kv(
        self, meta: Any, payload: Any, *, first_token: int, first_logprobs: Any = None, num_cached_tokens: int = 0,
        prompt_logprobs: Any = None,
    ) -> int: ...

    async def receive_kv_part(self, meta: Any, payload: Any, *, first_block: int) -> int: ...

    async def transfer_failed(self, request_id: str) -> None: ...

    async def sender_gone(self, sender: str) -> None: ...
