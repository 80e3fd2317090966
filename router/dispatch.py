"""Runs requests across the worker pools: placement, KV hand-off, streaming, re-runs.

A disaggregated request's way through the dispatcher::

    pick decode worker ─▶ reserve blocks ─▶ pick prefill worker ─▶ prefill (async)
        ─▶ stream deltas from the decode worker ─▶ finished / error / cancelled

Failures: a prefill worker that dies or fails the transfer makes the decode worker
apply its ``kv_failure_policy`` at once. A decode worker that dies before any token
reached the client is retried on another worker (up to ``max_retries``); once tokens
were delivered the client gets an error delta instead of a silently cut stream.
Cancellation (the consumer stops iterating) aborts the request on both workers, and so
does ``abort(request_id)`` from another task (a gRPC Abort), which also ends the stream
with finish_reason "abort".
With no prefill workers the decode workers run requests whole (colocated).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ray.exceptions import RayActorError

from decode_worker.worker import StreamDelta
from engine.sampling_params import SamplingParams
from router.placement import (
    PrefixIndex,
    decode_has_room,
    pick_decode,
    pick_prefill,
    prefix_hashes,
    round_robin,
)

PLACEMENTS = ("load", "round_robin")
# How a "no room anywhere" error delta begins, so the ingress can answer 503 (retryable).
NO_CAPACITY = "no decode worker had room"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerRef:
    worker_id: str
    handle: object  # a Ray actor handle


@dataclass(frozen=True)
class DispatchConfig:
    block_size: int = 16
    max_running_per_decode: int = 256
    max_retries: int = 2
    capacity_wait_s: float = 30.0  # how long a request may wait for KV room
    load_poll_s: float = 0.05
    placement: str = "load"  # "load": the load-aware policies; "round_robin": the baseline
    prefix_affinity: bool = True
    max_imbalance_tokens: int = 4096  # how much busier an affine prefill worker may be

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")


class NoCapacityError(RuntimeError):
    """No decode worker had room for the request within ``capacity_wait_s``."""


class Dispatcher:
    def __init__(
        self,
        prefill_workers: Callable[[], Sequence[WorkerRef]],
        decode_workers: Callable[[], Sequence[WorkerRef]],
        config: DispatchConfig | None = None,
    ) -> None:
        self._prefill = prefill_workers
        self._decode = decode_workers
        self.config = config or DispatchConfig()
        self._loads: dict[str, object] = {}
        self._pending_blocks: dict[str, int] = {}
        self._pending_tokens: dict[str, int] = {}
        self._ids = itertools.count()
        self._decode_ties = itertools.count()  # separate counters, so ties rotate within each pool
        self._prefill_ties = itertools.count()
        self._poller: asyncio.Task | None = None
        self._aborts: dict[str, asyncio.Event] = {}  # in-flight request id -> its abort signal
        self._prefixes = PrefixIndex()

    # -- load reports ----------------------------------------------------------

    async def refresh_loads(self) -> None:
        workers = [*self._prefill(), *self._decode()]
        results = await asyncio.gather(
            *(w.handle.load.remote() for w in workers), return_exceptions=True
        )
        for w, r in zip(workers, results):
            if isinstance(r, BaseException):
                self._loads.pop(w.worker_id, None)
            else:
                self._loads[w.worker_id] = r

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh_loads()
            except Exception:  # a poll must never die; the next one retries
                log.exception("load poll failed")
            await asyncio.sleep(self.config.load_poll_s)

    def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    # -- placement -------------------------------------------------------------

    def _choose_decode(self, blocks: int, exclude: set[str]) -> WorkerRef | None:
        workers = [w for w in self._decode() if w.worker_id in self._loads and w.worker_id not in exclude]
        loads = [self._loads[w.worker_id] for w in workers]
        pending = [self._pending_blocks.get(w.worker_id, 0) for w in workers]
        cap = self.config.max_running_per_decode
        if self.config.placement == "round_robin":
            room = [decode_has_room(load, blocks, cap, p) for load, p in zip(loads, pending)]
            i = round_robin(len(workers), next(self._decode_ties), room)
        else:
            i = pick_decode(loads, blocks, cap, pending, next(self._decode_ties))
        if i is None:
            return None
        self._pending_blocks[workers[i].worker_id] = pending[i] + blocks
        return workers[i]

    def _choose_prefill(self, prompt: list[int]) -> WorkerRef | None:
        workers = [w for w in self._prefill() if w.worker_id in self._loads]
        loads = [self._loads[w.worker_id] for w in workers]
        pending = [self._pending_tokens.get(w.worker_id, 0) for w in workers]
        if self.config.placement == "round_robin":
            hashes = []
            i = round_robin(len(workers), next(self._prefill_ties))
        else:
            hashes = prefix_hashes(prompt, self.config.block_size) if self.config.prefix_affinity else []
            cached = [self._prefixes.matched_blocks(w.worker_id, hashes) * self.config.block_size for w in workers]
            i = pick_prefill(loads, pending, next(self._prefill_ties), cached, self.config.max_imbalance_tokens)
        if i is None:
            return None
        self._pending_tokens[workers[i].worker_id] = pending[i] + len(prompt)
        self._prefixes.record(workers[i].worker_id, hashes)
        return workers[i]

    # -- requests --------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Stream the request's deltas; the last one is finished (or carries an error).

        ``abort(request_id)`` from any task ends the stream with finish_reason "abort".
        """
        self._ensure_polling()
        rid = request_id or f"d{next(self._ids)}"
        if rid in self._aborts:
            yield _error_delta(rid, f"request_id {rid!r} is already in flight")
            return
        aborted = self._aborts[rid] = asyncio.Event()
        abort_wait = asyncio.ensure_future(aborted.wait())
        try:
            async for delta in self._run(rid, prompt_token_ids, params, abort_wait):
                yield delta
        finally:
            abort_wait.cancel()
            del self._aborts[rid]

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._aborts

    def abort(self, request_id: str) -> bool:
        """Abort a request: its blocks are freed on every worker and its stream ends.

        Returns whether the request was in flight on this dispatcher.
        """
        event = self._aborts.get(request_id)
        if event is None:
            self._abort_everywhere(request_id)  # not ours: free whatever the workers hold
        else:
            event.set()  # its stream's task aborts it everywhere
        return event is not None

    async def _run(self, rid, prompt_token_ids, params, abort_wait) -> AsyncIterator[StreamDelta]:
        blocks = -(-(len(prompt_token_ids) + 1) // self.config.block_size)
        delivered = 0
        failed: set[str] = set()
        for attempt in range(self.config.max_retries + 1):
            try:
                decode, stream = await self._start(rid, prompt_token_ids, params, blocks, failed)
            except NoCapacityError as e:
                yield _error_delta(rid, str(e))
                return
            except BaseException:
                # Cancelled while placing: a reservation may already hold blocks.
                self._abort_everywhere(rid)
                raise
            try:
                while True:
                    delta = await _next_or_abort(stream, abort_wait)
                    if delta is None:
                        yield _error_delta(rid, "the decode worker ended the stream early")
                        return
                    if delta is _ABORTED:
                        self._abort_everywhere(rid)
                        yield _aborted_delta(rid, len(prompt_token_ids), delivered)
                        return
                    delivered += len(delta.token_ids)
                    yield delta
                    if delta.finished:
                        return
            except RayActorError:
                failed.add(decode.worker_id)
                self._loads.pop(decode.worker_id, None)
                if delivered:
                    yield _error_delta(
                        rid, f"decode worker {decode.worker_id} died after {delivered} tokens were sent"
                    )
                    return
                log.warning("decode worker %s died; re-running %s (attempt %d)", decode.worker_id, rid, attempt + 1)
            except BaseException:
                # Cancelled (client gone) or failed: free the request's blocks everywhere.
                self._abort_everywhere(rid)
                raise
        yield _error_delta(rid, f"request failed after {self.config.max_retries + 1} attempts")

    async def _start(self, rid, prompt, params, blocks, exclude):
        """Place the request and start its stream; waits (bounded) for KV room."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.capacity_wait_s
        while True:
            if not self._loads:
                await self.refresh_loads()
            decode = self._choose_decode(blocks, exclude)
            if decode is not None:
                if not self._prefill():
                    self._pending_blocks[decode.worker_id] -= blocks
                    stream = decode.handle.generate.options(num_returns="streaming").remote(rid, prompt, params)
                    return decode, stream
                try:
                    reservation = await decode.handle.reserve.remote(rid, prompt, params)
                except RayActorError:
                    # Died before taking the request: place it elsewhere.
                    exclude.add(decode.worker_id)
                    self._loads.pop(decode.worker_id, None)
                    continue
                finally:
                    # From here the worker's own load reports count the reservation.
                    self._pending_blocks[decode.worker_id] -= blocks
                if reservation is not None:
                    self._start_prefill(rid, prompt, params, decode, reservation)
                    stream = decode.handle.generate.options(num_returns="streaming").remote(rid)
                    return decode, stream
            if loop.time() > deadline:
                raise NoCapacityError(
                    f"{NO_CAPACITY} for {blocks} KV blocks within {self.config.capacity_wait_s}s"
                )
            await asyncio.sleep(self.config.load_poll_s)
            await self.refresh_loads()

    def _start_prefill(self, rid, prompt, params, decode: WorkerRef, reservation) -> None:
        prefill = self._choose_prefill(prompt)
        if prefill is None:
            decode.handle.transfer_failed.remote(rid)  # no prefill worker: policy decides
            return
        ref = prefill.handle.prefill.remote(rid, prompt, params, decode.handle, reservation)

        async def watch() -> None:
            try:
                await ref
            except Exception:
                # The prefill worker died or broke: don't make the decode side wait out the deadline.
                self._loads.pop(prefill.worker_id, None)
                self._prefixes.forget(prefill.worker_id)
                decode.handle.transfer_failed.remote(rid)
            finally:
                self._pending_tokens[prefill.worker_id] -= len(prompt)

        asyncio.get_running_loop().create_task(watch())

    def _abort_everywhere(self, rid: str) -> None:
        for w in [*self._prefill(), *self._decode()]:
            try:
                w.handle.abort.remote(rid)
            except Exception:  # a dead worker has nothing left to free
                pass


_ABORTED = object()


async def _next_delta(stream) -> StreamDelta | None:
    try:
        ref = await stream.__anext__()
    except StopAsyncIteration:
        return None
    return await ref


async def _next_or_abort(stream, abort_wait: asyncio.Future):
    """The stream's next delta (None at its end), or ``_ABORTED`` if the abort came first."""
    if abort_wait.done():
        return _ABORTED
    nxt = asyncio.ensure_future(_next_delta(stream))
    try:
        await asyncio.wait((nxt, abort_wait), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not nxt.done():
            nxt.cancel()
            nxt.add_done_callback(_swallow)  # its TaskCancelledError is expected
    return nxt.result() if nxt.done() and not nxt.cancelled() else _ABORTED


def _swallow(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _aborted_delta(rid: str, num_prompt_tokens: int, num_output_tokens: int) -> StreamDelta:
    return StreamDelta(
        request_id=rid,
        token_ids=[],
        text="",
        finished=True,
        finish_reason="abort",
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
    )


def _error_delta(rid: str, message: str) -> StreamDelta:
    return StreamDelta(request_id=rid, token_ids=[], text="", finished=True, finish_reason="error", error=message)
