"""The decode worker (a Ray actor): continuous batching over KV computed elsewhere.

A disaggregated request's lifecycle here::

    reserve ──▶ WAITING_FOR_REMOTE_KV ──receive_kv ok──▶ RUNNING ──▶ finished
                        │
                        ├─ transfer failed / deadline passed, policy recompute ─▶ WAITING (local prefill)
                        └─ policy fail ─▶ finished with an error

Each router replica holds one stream per decode worker: the worker's token channel
(``engine/token_channel.py``, a TCP connection) or the ``subscribe(subscriber)`` Ray
streaming generator; ``reserve`` (disaggregated) or ``submit`` (colocated: the
whole request runs here, no transfer) routes a request's deltas to it. The stream
carries one message per engine step with the deltas of all that subscriber's requests
and the worker's load after the step, so a router that streams from a worker never
has to poll its load.
Blocks are freed when a request finishes, is aborted, or its subscriber goes away.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import aclosing

import ray

from engine.async_engine import merge_outputs
from engine.messages import DecodeLoad, ErrorKind, Reservation, TransferState
from engine.sampling_params import SamplingParams
from engine.token_channel import ChannelAddress, ChannelServer
from kv_transfer import TransferError, TransferMeta
from workers.base import WorkerBase

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(
        self, *args, stream_interval_s: float = 0.0, token_channel_host: str | None = None, **kwargs
    ) -> None:
        """``WorkerBase``'s arguments; ``stream_interval_s``: at most one message per stream
        per interval; ``token_channel_host``: where the token channel listens (None: none,
        subscribers use the Ray stream)."""
        super().__init__(*args, **kwargs)
        self._channel_host = token_channel_host
        self._channel = None if token_channel_host is None else ChannelServer(self._serve_channel)
        self._streams = {"channel": 0, "ray": 0}  # subscriber streams opened so far, by path
        self._endpoint = self.backend.endpoint  # senders connect here; opened once, up front
        self.stream_interval_s = stream_interval_s
        self.runtime.add_periodic(self._expire_reservations)
        self._deadlines: dict[str, float] = {}
        # Paged transfers write into reserved blocks from a reader thread. Each reservation
        # pins its blocks (one more reference) so that nothing else can take them, even if
        # the request ends meanwhile, until no read can write into them any more.
        self._pins: dict[str, list] = {}
        self._reading: set[str] = set()
        self._landed: dict[str, int] = {}  # pipelined prefill: blocks already read, in order
        self._pin_lock = threading.Lock()
        self.num_transfer_failures = 0
        self.runtime.step_report = self._load  # rides on every step message (``subscribe``)

    # -- health and load -------------------------------------------------------

    async def ready(self) -> dict:
        if self._channel is not None:  # on the actor's event loop, where its outboxes live
            wildcard = self._channel_host in ("0.0.0.0", "::", "")
            node_ip = ray.util.get_node_ip_address() if wildcard else None
            await self._channel.start(self._channel_host, advertise=node_ip)
        return {**await super().ready(), "layout": self.layout}

    def _load(self) -> DecodeLoad:
        load = self.engine.load()
        return DecodeLoad(
            worker_id=self.worker_id,
            free_blocks=load.num_free_blocks,
            total_blocks=load.num_blocks,
            running=load.num_running,
            waiting=load.num_waiting + load.num_swapped,
            waiting_for_kv=load.num_waiting_for_kv,
        )

    async def stats(self) -> dict:
        return {**await super().stats(), "transfer_failures": self.num_transfer_failures,
                "streams": dict(self._streams)}

    # -- disaggregated requests ------------------------------------------------

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber: str,
        resume_output: list[int] = (), priority: int = 0,
    ) -> Reservation | None:
        """Reserve blocks for the prompt's KV; None when this worker has no room now.

        The request's deltas will go to ``subscriber``'s stream (``subscribe``).
        ``resume_output``: a migrated stream's tokens so far, whose KV comes with the prompt's.
        ``priority``: the request's place in the scheduler's order (lower goes first).
        """
        return await self.runtime.call(
            self._reserve, request_id, prompt_token_ids, params, subscriber, resume_output, priority
        )

    def _reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber: str,
        resume_output=(), priority: int = 0,
    ) -> Reservation | None:
        reserved = self.engine.add_remote_request(
            prompt_token_ids, params, request_id=request_id, priority=priority, resume_output=resume_output
        )
        if reserved is None:
            self.runtime.abort_now(request_id)
            return None
        blocks, held = reserved
        self.runtime.route(request_id, subscriber)
        if self.backend.paged:
            with self._pin_lock:
                self._pins[request_id] = self.engine.pin_blocks(request_id)
                if held:  # reads start after the blocks already here
                    self._landed[request_id] = held
        deadline = time.time() + self.transfer.timeout_s
        self._deadlines[request_id] = deadline
        return Reservation(request_id, blocks, self.layout, self._endpoint, deadline, held)

    async def receive_kv(
        self, meta: TransferMeta, payload, first_token: int, first_logprobs=None, num_cached_tokens: int = 0,
        prompt_logprobs=None,
    ) -> int:
        """Pull the prompt's KV into the reserved blocks; returns the TransferState.

        ``num_cached_tokens``: the prompt tokens the prefill worker found in its prefix
        cache, reported in the request's usage. ``prompt_logprobs``: the prompt's, when the
        request asked for them; they go out with the first token.
        """
        rid = meta.request_id
        if self.backend.paged:
            return await self._receive_in_place(
                meta, payload, first_token, first_logprobs, num_cached_tokens, prompt_logprobs
            )
        try:
            if meta.layout != self.layout:
                raise TransferError("layout", f"KV layout {meta.layout} does not match {self.layout}")
            t0 = time.perf_counter()
            k, v = await self.backend.pull_async(meta, payload)
            self.metrics.on_transfer(time.perf_counter() - t0, k.nbytes + v.nbytes)
        except Exception as e:  # any failure ends this transfer; the policy decides what follows
            await self.runtime.call(self._transfer_failed, rid, self._failure_reason(e))
            return int(TransferState.FAILED)
        try:
            await self.runtime.call(
                self._kv_arrived, rid, first_token, k, v, first_logprobs, num_cached_tokens, prompt_logprobs
            )
        except Exception:
            # The hand-over ran and failed: recycle anyway, as a backend (nixl) holds its
            # receive buffers until then. Not on cancellation: the step thread may still
            # be about to copy from them.
            self.backend.recycle(k, v)
            raise
        self.backend.recycle(k, v)
        return int(TransferState.DONE)

    async def receive_kv_part(self, meta: TransferMeta, payload, first_block: int) -> int:
        """Pipelined prefill (paged backends): read blocks whose KV a prefill still running
        has finished, from the ``first_block``-th of the reservation on, while its next
        chunks compute. Parts come in order; ``receive_kv`` brings the rest and the first
        token. Returns the TransferState; a failure applies the policy at once."""
        rid = meta.request_id
        with self._pin_lock:
            landed = self._landed.get(rid, 0)
        if first_block != landed:
            e = TransferError("layout", f"transfer {meta.transfer_id}: part at block {first_block}, "
                                        f"{landed} blocks landed so far")
            await self.runtime.call(self._transfer_failed, rid, self._failure_reason(e))
            return int(TransferState.FAILED)
        if not await self._read_in_place(meta, payload, first_block):
            return int(TransferState.FAILED)
        with self._pin_lock:
            self._reading.discard(rid)  # until the next part: the deadline may expire it meanwhile
            self._landed[rid] = first_block + meta.num_blocks
        return int(TransferState.DONE)

    async def _receive_in_place(
        self, meta: TransferMeta, payload, first_token, first_logprobs, num_cached_tokens, prompt_logprobs
    ):
        """Paged backends: read the sender's blocks straight into the reserved ones (those
        a pipelined prefill's parts did not bring already)."""
        with self._pin_lock:
            landed = self._landed.pop(meta.request_id, 0)
        if not await self._read_in_place(meta, payload, landed):
            return int(TransferState.FAILED)
        await self.runtime.call(
            self._kv_arrived, meta.request_id, first_token, None, None, first_logprobs, num_cached_tokens,
            prompt_logprobs,
        )
        return int(TransferState.DONE)

    async def _read_in_place(self, meta: TransferMeta, payload, first_block: int) -> bool:
        """Read ``meta.num_blocks`` blocks into the reservation's from ``first_block`` on.
        False when it failed (the failure policy has run). On success the request stays
        marked as reading, so that no deadline ends it before the caller hands it on."""
        rid = meta.request_id
        with self._pin_lock:
            blocks = self._pins.get(rid)
            if blocks is not None:
                self._reading.add(rid)
        if blocks is None:  # the reservation ended (aborted, expired) before the KV came
            await self.runtime.call(self._transfer_failed, rid, "expired")
            return False
        targets = [b.block_id for b in blocks[first_block : first_block + meta.num_blocks]]
        try:
            if meta.layout != self.layout:
                raise TransferError("layout", f"KV layout {meta.layout} does not match {self.layout}")
            if len(targets) != meta.num_blocks:
                raise TransferError("layout", f"transfer {meta.transfer_id}: {meta.num_blocks} blocks from block "
                                              f"{first_block} do not fit a reservation of {len(blocks)}")
            if targets:
                t0 = time.perf_counter()
                await self.backend.pull_blocks_async(meta, payload, targets)
                self.metrics.on_transfer(time.perf_counter() - t0, self.layout.nbytes(meta.num_blocks))
        except Exception as e:
            # A read that could not be stopped may still write into the blocks: keep them.
            unpin = getattr(e, "reason", None) != "stuck"
            if not unpin:
                log.error("transfer %s: %s; its %d blocks stay out of use", meta.transfer_id, e, len(blocks))
            await self.runtime.call(self._transfer_failed, rid, self._failure_reason(e), unpin)
            return False
        return True

    def _unpin(self, rid: str) -> None:
        """On the step thread: the reservation's blocks may go back to the pool."""
        with self._pin_lock:
            self._reading.discard(rid)
            self._landed.pop(rid, None)
            blocks = self._pins.pop(rid, None)
        if blocks is not None:
            self.engine.unpin_blocks(blocks)

    def _failure_reason(self, e: BaseException) -> str:
        reason = getattr(e, "reason", "timeout" if isinstance(e, asyncio.TimeoutError) else type(e).__name__)
        self.backend.stats.failures[reason] += 1
        self.metrics.on_transfer_failure(reason)
        return reason

    def _kv_arrived(
        self, rid: str, first_token: int, k, v, first_logprobs, num_cached_tokens: int, prompt_logprobs=None
    ) -> None:
        self._unpin(rid)
        self._deadlines.pop(rid, None)
        out = self.engine.remote_kv_arrived(
            rid, first_token, k, v, first_logprobs, num_cached_tokens, prompt_logprobs
        )
        if out is not None:
            self.runtime.deliver(out)

    async def transfer_failed(self, request_id: str) -> None:
        """The KV will not come (the sender or the router says so)."""
        await self.runtime.call(self._transfer_failed, request_id)

    def _transfer_failed(self, request_id: str, reason: str = "", unpin: bool = True) -> None:
        """On the step thread: recompute the prompt here, or fail the request."""
        with self._pin_lock:
            if request_id in self._reading and not reason:
                # Told by the sender or the router while a read still runs: its own end decides.
                return
        if unpin:
            self._unpin(request_id)
        self._deadlines.pop(request_id, None)
        if not self.engine.is_waiting_for_kv(request_id):
            return
        self.num_transfer_failures += 1
        out = self.engine.remote_kv_failed(request_id, self.transfer.failure_policy == "recompute")
        if out is not None:
            self.runtime.deliver(out)

    def _expire_reservations(self, now: float) -> None:
        expired = [rid for rid, d in self._deadlines.items() if d < now and rid not in self._reading]
        for rid in expired:  # a read in progress ends by the same deadline and reports itself
            self.backend.stats.failures["timeout"] += 1
            self.metrics.on_transfer_failure("timeout")
            self._transfer_failed(rid, "timeout")
        if self._pins:
            self._drop_stale_pins()

    def _drop_stale_pins(self) -> None:
        """Unpin reservations that ended (aborted, finished) without a read in progress."""
        waiting = self.engine.is_waiting_for_kv
        with self._pin_lock:
            stale = [rid for rid in self._pins if not waiting(rid) and rid not in self._reading]
            for rid in stale:
                self.engine.unpin_blocks(self._pins.pop(rid))

    # -- streaming -------------------------------------------------------------

    async def subscribe(self, subscriber: str):
        """Stream, per engine step, the deltas of every request routed to ``subscriber``.

        One message (a ``StepMessage``: this worker's load after the step, and a list of
        plain delta tuples) per step that produced anything for the subscriber, however
        many of its requests ran in the step. When the subscriber goes away (its stream
        is cancelled or dropped), its unfinished requests are aborted and their blocks
        freed. The token channel (``token_channel``) carries the same messages over TCP.
        """
        self._streams["ray"] += 1
        async with aclosing(self._step_messages(subscriber)) as messages:
            async for message in messages:
                yield message

    async def token_channel(self) -> ChannelAddress | None:
        """Where this worker's token channel listens (None: only ``subscribe``)."""
        return None if self._channel is None else self._channel.address

    async def _serve_channel(self, subscriber: str, send) -> None:
        self._streams["channel"] += 1
        async with aclosing(self._step_messages(subscriber)) as messages:
            async for message in messages:
                await send(message)

    async def _step_messages(self, subscriber: str):
        outbox = await self.runtime.call(self.runtime.open_outbox, subscriber)
        reader = outbox.claim()  # a re-subscription (new event loop, say) replaces the old stream
        try:
            while (pending := await outbox.take(reader)) is not None:
                yield outbox.report, [_wire(rid, items) for rid, items in pending.items()]
                if self.stream_interval_s:
                    # Tokens of the steps meanwhile merge into the next message.
                    await asyncio.sleep(self.stream_interval_s)
        finally:
            self.runtime.submit(self._drop_subscriber, subscriber, reader)

    def _drop_subscriber(self, subscriber: str, reader: int) -> None:
        for rid in self.runtime.close_outbox(subscriber, reader):
            self._deadlines.pop(rid, None)
            self.runtime.abort_now(rid)

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber: str,
        resume_output: list[int] = (), priority: int = 0,
    ) -> None:
        """Run the whole request here (colocated mode, or a stream migrated from a dead
        worker, ``resume_output`` being the tokens it had sent); deltas go to ``subscriber``.
        ``priority``: the request's place in the scheduler's order (lower goes first)."""
        await self.runtime.call(
            self._submit, request_id, prompt_token_ids, params, subscriber, resume_output, priority
        )

    def _submit(self, request_id, prompt_token_ids, params, subscriber: str, resume_output, priority: int) -> None:
        self.runtime.route(request_id, subscriber)
        try:
            self.engine.add_request(
                prompt_token_ids, params, request_id=request_id, priority=priority, resume_output=resume_output
            )
        except BaseException:
            self.runtime.unroute(request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self.runtime.submit(self._deadlines.pop, request_id, None)  # on the step thread, like the rest
        await super().abort(request_id)


class ColocatedWorker(DecodeWorker):
    """Both phases in one worker, no transfer: ``submit`` with a prompt."""

    role = "colocated"


TRANSFER_FAILED_MESSAGE = "the KV transfer failed and kv_failure_policy is 'fail'"


def _wire(rid: str, items: list) -> tuple:
    """A request's outputs since its last message as one ``StreamDelta`` tuple."""
    for item in items:
        if isinstance(item, BaseException):
            return (rid, [], "", True, "error", 0, 0, 0, None,
                    f"the decode worker failed: {item}", ErrorKind.WORKER_FAILED.value, None)
    out = merge_outputs(items)
    lps = out.new_logprobs
    if lps is not None:
        lps = [(lp.token_id, lp.logprob, list(lp.top)) for lp in lps]
    error = kind = None
    if out.finish_reason == "error":
        error, kind = TRANSFER_FAILED_MESSAGE, ErrorKind.TRANSFER_FAILED.value
    prompt_lps = out.prompt_logprobs
    if prompt_lps is not None:
        prompt_lps = [
            None if lp is None else (lp.token_id, lp.logprob, lp.rank, list(lp.top)) for lp in prompt_lps
        ]
    return (rid, out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.num_prompt_tokens,
            out.num_output_tokens, out.num_cached_tokens, lps, error, kind, prompt_lps)
