"""Typed calls to the worker actors: ``DecodeClient(handle).reserve(...)`` rather than
``handle.reserve.remote(...)``. Each method takes the parameters of its call in
``engine.wire.worker_api`` and returns what Ray's ``.remote`` does (an ``ObjectRef``,
awaited for the answer), typed as an awaitable of the answer: a type checker sees
through the actor handle, which it cannot (``tests/unit/test_worker_api.py`` keeps the
two lists of parameters equal).

A client is a handle and the epoch of the caller's view of the worker (``WorkerRef.epoch``;
None for a worker that never switches roles). Placements and load polls carry it
(``WorkerRef.fence``): a pool worker that took another role since refuses them
(``StalePlacement``). Aborts and notices about a transfer carry none: they concern
whatever the worker holds, whatever role it has now.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Sequence
from typing import Any, Self

from engine.wire.messages import DecodeLoad, PrefillLoad, PrefillResult, Reservation, WorkerRef
from engine.wire.sampling_params import SamplingParams
from engine.wire.token_channel import ChannelAddress


class WorkerClient:
    """The calls any worker answers."""

    __slots__ = ("epoch", "handle")

    def __init__(self, handle: Any, epoch: int | None = None) -> None:
        self.handle = handle  # a Ray actor handle, or a stand-in with the same ``<call>.remote``
        self.epoch = epoch

    @classmethod
    def of(cls, worker: WorkerRef) -> Self:
        """A client for the worker as ``worker`` (a router's view of it) sees it."""
        return cls(worker.handle, worker.epoch)

    def _fence(self) -> dict[str, int]:
        return {} if self.epoch is None else {"epoch": self.epoch}

    def load(self) -> Awaitable[PrefillLoad | DecodeLoad]:
        """Its load for placement (fenced)."""
        load: Awaitable[PrefillLoad | DecodeLoad] = self.handle.load.remote(**self._fence())
        return load

    def abort(self, request_id: str) -> Awaitable[None]:
        """Abort one attempt (the id it was placed under)."""
        done: Awaitable[None] = self.handle.abort.remote(request_id)
        return done

    def abort_request(self, request_id: str) -> Awaitable[None]:
        """Abort every attempt of the client's ``request_id``."""
        done: Awaitable[None] = self.handle.abort_request.remote(request_id)
        return done


class PrefillClient(WorkerClient):
    """A prefill worker's calls (``PrefillWorkerAPI``)."""

    __slots__ = ()

    def load(self) -> Awaitable[PrefillLoad]:
        load: Awaitable[PrefillLoad] = self.handle.load.remote(**self._fence())
        return load

    def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, decode_worker: Any,
        reservation: Reservation, resume_output: Sequence[int] = (), priority: int = 0,
    ) -> Awaitable[PrefillResult]:
        """Prefill the prompt and hand its KV to ``decode_worker`` (its actor handle), into
        ``reservation`` (fenced)."""
        result: Awaitable[PrefillResult] = self.handle.prefill.remote(
            request_id, prompt_token_ids, params, decode_worker=decode_worker, reservation=reservation,
            resume_output=resume_output, priority=priority, **self._fence(),
        )
        return result


class DecodeClient(WorkerClient):
    """A decode (or colocated) worker's calls (``DecodeWorkerAPI``)."""

    __slots__ = ()

    def load(self) -> Awaitable[DecodeLoad]:
        load: Awaitable[DecodeLoad] = self.handle.load.remote(**self._fence())
        return load

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0,
    ) -> Awaitable[Reservation | None]:
        """Blocks for the prompt's KV, its deltas routed to ``subscriber`` (fenced); None: no room."""
        reservation: Awaitable[Reservation | None] = self.handle.reserve.remote(
            request_id, prompt_token_ids, params, subscriber=subscriber, resume_output=resume_output,
            priority=priority, **self._fence(),
        )
        return reservation

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0,
    ) -> Awaitable[None]:
        """Run the whole request there, its deltas routed to ``subscriber`` (fenced)."""
        done: Awaitable[None] = self.handle.submit.remote(
            request_id, prompt_token_ids, params, subscriber=subscriber, resume_output=resume_output,
            priority=priority, **self._fence(),
        )
        return done

    def subscribe(self, subscriber: str) -> AsyncIterable[Awaitable[Any]]:
        """``subscriber``'s stream of step messages over Ray: a reference to await per message."""
        stream: AsyncIterable[Awaitable[Any]] = self.handle.subscribe.options(num_returns="streaming").remote(
            subscriber)
        return stream

    def token_channel(self) -> Awaitable[ChannelAddress | None]:
        """Where its token channel listens (None: it has none)."""
        address: Awaitable[ChannelAddress | None] = self.handle.token_channel.remote()
        return address

    def receive_kv(
        self, meta: Any, payload: Any, *, first_token: int, first_logprobs: Any = None, num_cached_tokens: int = 0,
        prompt_logprobs: Any = None,
    ) -> Awaitable[int]:
        """Read the rest of a reservation's KV and start decoding; answers a ``TransferState``."""
        state: Awaitable[int] = self.handle.receive_kv.remote(
            meta, payload, first_token=first_token, first_logprobs=first_logprobs,
            num_cached_tokens=num_cached_tokens, prompt_logprobs=prompt_logprobs,
        )
        return state

    def receive_kv_part(self, meta: Any, payload: Any, *, first_block: int) -> Awaitable[int]:
        """Read blocks of a prefill still running, from the reservation's ``first_block``-th on."""
        state: Awaitable[int] = self.handle.receive_kv_part.remote(meta, payload, first_block=first_block)
        return state

    def transfer_failed(self, request_id: str) -> Awaitable[None]:
        """The attempt's KV will not come: its failure policy runs now."""
        done: Awaitable[None] = self.handle.transfer_failed.remote(request_id)
        return done

    def sender_gone(self, sender: str) -> Awaitable[None]:
        """Prefill worker ``sender`` is gone: nothing read from it can still land."""
        done: Awaitable[None] = self.handle.sender_gone.remote(sender)
        return done
