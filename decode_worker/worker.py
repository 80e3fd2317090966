"""The decode worker (a Ray actor): continuous batching over KV computed elsewhere.

A disaggregated request's lifecycle here::

    reserve ──▶ WAITING_FOR_REMOTE_KV ──receive_kv ok──▶ RUNNING ──▶ finished
                        │
                        ├─ transfer failed / deadline passed, policy recompute ─▶ WAITING (local prefill)
                        └─ policy fail ─▶ finished with an error

Each router replica holds one stream per decode worker: the worker's token channel
(``engine/wire/token_channel.py``, a TCP connection) or the ``subscribe(subscriber)`` Ray
streaming generator; ``reserve`` (disaggregated) or ``submit`` (colocated: the
whole request runs here, no transfer) routes a request's deltas to it. The stream
carries one message per engine step with the deltas of all that subscriber's requests
and the worker's load after the step, so a router that streams from a worker never
has to poll its load.
Blocks are freed when a request finishes, is aborted, or its subscriber goes away (on
the token channel: no reconnect within ``reconnect_grace_s``, so a network blip moves
nothing).

A subscriber's lifecycle here, by the size of its outbox (outputs not yet sent)::

    within max_pending_outputs ──past it──▶ over (the next message carries a SLOW notice)
          ▲                                   │
          └───── its reader takes them ◀──────┤
                                              └─ still over after slow_subscriber_s, or past
                                                 twice the bound ──▶ cut off (a CUT notice;
                                                 its requests aborted, their blocks freed)

The request id here is the router's attempt id. Each reservation has a hand-off record
(``kv_transfer.handoff.Receiver``, which locks it for the reads and the step thread that
both ask) that says which read may run, when the KV is whole and when the reserved
blocks' pins come back. Receiving KV: ``receive_kv`` (or ``receive_kv_part``) ─▶
``_read`` (the record allows it, ``_pull`` reads and checks it, the record hears how it
ended) ─▶ ``_kv_arrived`` (the request runs) or ``_ended`` (pins back, failure policy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, cast

import ray

from decode_worker.outbox import Subscribers
from engine.async_engine import merge_outputs
from engine.output_processor import RequestOutput
from engine.wire.channel_wire import Notice, NoticeKind
from engine.wire.messages import DecodeLoad, ErrorKind, Reservation, StepMessage, TransferState
from engine.wire.sampling_params import SamplingParams
from engine.wire.token_channel import ChannelAddress, ChannelConfig, ChannelServer
from kv_transfer import TransferError, TransferMeta, checksum
from kv_transfer.handoff import Ended, HandoffError, Read, Receiver
from kv_transfer.worker import WorkerBase

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    """The decode role's Ray actor (the module docstring has a request's and a subscriber's
    lifecycle): it reserves blocks, receives KV, runs the continuous batch and streams step
    messages to routers. The cluster starts one per decode slot and replaces it if it dies."""

    role = "decode"

    def __init__(
        self, *args: Any, stream_interval_s: float = 0.0, token_channel_host: str | None = None,
        channel: ChannelConfig | None = None, **kwargs: Any,
    ) -> None:
        """``WorkerBase``'s arguments; ``stream_interval_s``: at most one message per stream
        per interval; ``token_channel_host``: where the token channel listens (None: none,
        subscribers use the Ray stream); ``channel``: its timings, and the bound on each
        subscriber's pending outputs (either path)."""
        super().__init__(*args, **kwargs)
        self.channel_config = channel or ChannelConfig()
        self._channel_host = token_channel_host
        self._channel = (
            None if token_channel_host is None else ChannelServer(self._serve_channel, self.channel_config)
        )
        self.num_cut_off = 0  # subscribers cut off for falling behind
        self._streams = {"channel": 0, "ray": 0}  # subscriber streams opened so far, by path
        self._endpoint = self.backend.endpoint  # senders connect here; opened once, up front
        self.stream_interval_s = stream_interval_s
        self.async_engine.add_periodic(self._expire_reservations)
        self.async_engine.add_periodic(self._cut_slow_subscribers)
        self.handoff: Receiver[list[Any]] = Receiver()  # one hand-off record per reservation, holding its pins
        self.num_transfer_failures = 0  # requests whose KV did not come (the failure policy ran)
        # Each subscriber's outbox, and the subscriber each request's outputs go to; the
        # load after each step rides on every step message (``subscribe``).
        self.subscribers = Subscribers(self.async_engine, report=self._load)
        self.async_engine.sink = self.subscribers

    # -- health and load -------------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        # On the actor's event loop, where its outboxes live.
        if self._channel is not None and self._channel_host is not None:
            wildcard = self._channel_host in ("0.0.0.0", "::", "")
            node_ip = ray.util.get_node_ip_address() if wildcard else None  # type: ignore[no-untyped-call]
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

    async def stats(self) -> dict[str, Any]:
        records = {rid: state.name for rid, state in self.handoff.states().items()}
        return {**await super().stats(), "transfer_failures": self.num_transfer_failures,
                "streams": dict(self._streams), "subscribers_cut_off": self.num_cut_off, "handoffs": records}

    # -- disaggregated requests ------------------------------------------------

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0,
    ) -> Reservation | None:
        """Reserve blocks for the prompt's KV; None when this worker has no room now.

        The request's deltas will go to ``subscriber``'s stream (``subscribe``).
        ``resume_output``: a migrated stream's tokens so far, whose KV comes with the prompt's.
        ``priority``: the request's place in the scheduler's order (lower goes first).
        """
        reservation: Reservation | None = await self.async_engine.call(
            self._reserve, request_id, prompt_token_ids, params, subscriber, resume_output, priority
        )
        return reservation

    def _reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber: str,
        resume_output: Sequence[int], priority: int,
    ) -> Reservation | None:
        if request_id in self.handoff:  # a quarantined read may outlive its request
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.draining:
            return None  # no room here: the router places it elsewhere
        reserved = self.engine.add_remote_request(
            prompt_token_ids, params, request_id=request_id, priority=priority, resume_output=resume_output
        )
        if reserved is None:
            return None
        blocks, held = reserved
        self.subscribers.route(request_id, subscriber)
        # Transfers write into the reserved blocks from a reader thread: one more reference
        # each keeps them out of the pool, whatever happens to the request, until the
        # hand-off record gives them back.
        pins = self.engine.pin_blocks(request_id)
        self.handoff.reserve(request_id, blocks, held, time.monotonic() + self.transfer.timeout_s, pins)
        return Reservation(request_id, blocks, self.layout, self._endpoint, time.time() + self.transfer.timeout_s, held,
                           adapter_key=self.engine.check_adapter(params.adapter))

    async def receive_kv(
        self, meta: TransferMeta, payload: Any, *, first_token: int, first_logprobs: Any = None,
        num_cached_tokens: int = 0, prompt_logprobs: Any = None,
    ) -> int:
        """Read the rest of the prompt's KV into the reserved blocks and start decoding;
        returns the TransferState. The read must end at the reservation's last block.

        ``num_cached_tokens``: the prompt tokens the prefill worker found in its prefix
        cache, reported in the request's usage. ``prompt_logprobs``: the prompt's, when the
        request asked for them; they go out with the first token.
        """
        if not await self._read(meta, payload, None, last=True):
            return int(TransferState.FAILED)
        await self.async_engine.call(
            self._kv_arrived, meta.request_id, first_token, first_logprobs, num_cached_tokens, prompt_logprobs
        )
        return int(TransferState.DONE)

    async def receive_kv_part(self, meta: TransferMeta, payload: Any, *, first_block: int) -> int:
        """Pipelined prefill: read blocks whose KV a prefill still running
        has finished, from the ``first_block``-th of the reservation on, while its next
        chunks compute. Parts come in order; ``receive_kv`` brings the rest and the first
        token. Returns the TransferState; a failure applies the policy at once."""
        ok = await self._read(meta, payload, first_block, last=False)
        return int(TransferState.DONE if ok else TransferState.FAILED)

    async def _read(self, meta: TransferMeta, payload: Any, first: int | None, last: bool) -> bool:
        """Read ``meta.num_blocks`` blocks of the reservation from ``first`` on (None:
        where the last part ended), as its hand-off record allows; whether they landed.
        On failure the record has ended and the failure policy has run."""
        rid = meta.request_id
        try:
            if meta.layout != self.layout:
                raise TransferError("layout", f"KV layout {meta.layout} does not match {self.layout}")
            read = self.handoff.next_read(rid, first, meta.num_blocks, time.monotonic(), last=last, sender=meta.sender)
        except (TransferError, HandoffError) as e:
            await self.backend.refuse_async(meta, payload)  # a push already on its way must end
            await self.async_engine.call(self._transfer_failed, rid, self._count_failure(e))
            return False
        failure = await self._pull(meta, payload, read)
        error = "" if failure is None else self._count_failure(failure)
        ended = self.handoff.end_read(rid, error, stuck=error == "stuck")
        if failure is not None and error == "stuck":  # it may still write into the blocks: out of use until it settles
            log.error("transfer %s: %s; its %d blocks stay out of use", meta.transfer_id, failure,
                      len(read.block_ids))
            self._when_settled(failure, rid)
        if ended is not None:
            await self.async_engine.call(self._ended, ended)
            return False
        return not error

    async def _pull(self, meta: TransferMeta, payload: Any, read: Read) -> Exception | None:
        """Read the KV into the blocks the record allowed, by its deadline, and check the
        blocks' sums; returns what failed (None: they landed whole)."""
        # The backend waits by this side's clock: the deadline the record keeps.
        meta = dataclasses.replace(meta, deadline=time.time() + read.time_left)
        try:
            if meta.dst_blocks and tuple(read.block_ids) != meta.dst_blocks:
                await self.backend.refuse_async(meta, payload)
                raise TransferError("order", f"transfer {meta.transfer_id} offers blocks for another place "
                                             f"in the reservation than block {read.first}")
            t0 = time.perf_counter()
            if read.block_ids:  # every rank reads its heads (``kv_transfer.sharded``)
                await self.kv_ranks.read(self.backend, meta, payload, read.block_ids)
            self.metrics.on_transfer(time.perf_counter() - t0, self.layout.nbytes(meta.num_blocks))
            if meta.checksums:  # summed off the event loop, each rank its heads
                checksum.check(meta, await self.kv_ranks.checksums(read.block_ids))
        except Exception as e:  # any failure ends this attempt; the policy decides what follows
            return e
        return None

    def _when_settled(self, error: BaseException, rid: str) -> None:
        """A stuck read's blocks come back once the read is known to have ended (a backend
        that can tell hands a future with its error)."""
        settled = getattr(error, "settled", None)
        if settled is not None:
            settled.add_done_callback(lambda _: self.async_engine.submit(self._settle, rid))

    def _settle(self, rid: str) -> None:
        if (ended := self.handoff.settled(rid)) is not None:
            self._ended(ended)

    async def sender_gone(self, sender: str) -> None:
        """A prefill worker is gone: nothing it was read from can land any more."""
        await self.async_engine.call(self._sender_gone, sender)

    def _sender_gone(self, sender: str) -> None:
        for e in self.handoff.sender_gone(sender):
            self._ended(e)

    def _kv_arrived(
        self, rid: str, first_token: int, first_logprobs: Any, num_cached_tokens: int, prompt_logprobs: Any,
    ) -> None:
        """On the step thread: the whole reservation has landed; the request runs."""
        try:
            ended = self.handoff.complete(rid)
        except HandoffError:
            return  # it ended meanwhile (aborted, expired): that end has been handled
        self._ended(ended)
        out = self.engine.remote_kv_arrived(
            rid, first_token, None, None, first_logprobs, num_cached_tokens, prompt_logprobs
        )
        if out is not None:
            self.async_engine.deliver(out)

    def _ended(self, ended: Ended[list[Any]]) -> None:
        """On the step thread: a hand-off record ended; give its blocks back, and apply
        the failure policy if the KV will not come."""
        if ended.pins is not None:
            self.engine.unpin_blocks(ended.pins)
        if not ended.failed or not self.engine.is_waiting_for_kv(ended.attempt_id):
            return
        self.num_transfer_failures += 1
        out = self.engine.remote_kv_failed(ended.attempt_id, self.transfer.failure_policy == "recompute")
        if out is not None:
            self.async_engine.deliver(out)

    async def transfer_failed(self, request_id: str) -> None:
        """The KV will not come (the sender or the router says so). A read in flight
        decides for itself."""
        await self.async_engine.call(self._transfer_failed, request_id, "sender")

    def _transfer_failed(self, request_id: str, reason: str) -> None:
        if (ended := self.handoff.fail(request_id, reason)) is not None:
            self._ended(ended)

    def _expire_reservations(self, now: float) -> None:
        """Periodic, on the step thread: reservations past their deadline apply the
        policy; those whose request ended some other way give their blocks back."""
        if not len(self.handoff):
            return
        for e in self.handoff.sweep(now, self.engine.is_waiting_for_kv):
            if e.reason == "timeout":
                self._count_failure(e.reason)
            self._ended(e)

    async def _let_go(self) -> None:
        for _, outbox in await self.async_engine.call(self.subscribers.outboxes):
            outbox.claim()  # its reader's stream ends: the router moves on as from a gone worker
        if self._channel is not None:
            self._channel.close()

    def _abort_everything(self) -> None:
        for rid in {*self.engine.request_ids(), *self.handoff.states()}:
            self.abort_now(rid)

    def abort_now(self, request_id: str) -> None:
        if (ended := self.handoff.abort(request_id)) is not None:
            self._ended(ended)
        super().abort_now(request_id)

    # -- streaming -------------------------------------------------------------

    async def subscribe(self, subscriber: str) -> AsyncGenerator[StepMessage | Notice, None]:
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

    async def _serve_channel(self, subscriber: str, send: Callable[[object], Awaitable[None]]) -> None:
        self._streams["channel"] += 1
        async with aclosing(self._step_messages(subscriber)) as messages:
            async for message in messages:
                await send(message)

    async def _step_messages(self, subscriber: str) -> AsyncGenerator[StepMessage | Notice, None]:
        outbox = await self.async_engine.call(self.subscribers.open, subscriber)
        reader = outbox.claim()  # a re-subscription (new event loop, say) replaces the old stream
        limit = self.channel_config.max_pending_outputs
        try:
            while (pending := await outbox.take(reader)) is not None:
                if outbox.taken > limit:
                    yield Notice(NoticeKind.SLOW, f"{outbox.taken} outputs were waiting (max_pending_outputs "
                                                  f"{limit}) on decode worker {self.worker_id}")
                yield outbox.report, [_wire(rid, items) for rid, items in pending.items()]
                if self.stream_interval_s:
                    # Tokens of the steps meanwhile merge into the next message.
                    await asyncio.sleep(self.stream_interval_s)
            if outbox.cut:
                yield Notice(NoticeKind.CUT, f"decode worker {self.worker_id} cut this router off: more than "
                                             f"{limit} outputs (max_pending_outputs) waited for it for "
                                             f"{self.channel_config.slow_subscriber_s}s, or more than {2 * limit}")
        finally:
            self.async_engine.submit(self._drop_subscriber, subscriber, reader)

    def _drop_subscriber(self, subscriber: str, reader: int) -> None:
        for rid in self.subscribers.close(subscriber, reader):
            self.abort_now(rid)

    def _cut_slow_subscribers(self, now: float) -> None:
        """Periodic, on the step thread: a subscriber whose outbox has stayed past the
        bound is cut off, its requests aborted, whether or not its reader is stuck."""
        cfg = self.channel_config
        for subscriber, outbox in self.subscribers.outboxes():
            if outbox.backlog(now, cfg.max_pending_outputs, cfg.slow_subscriber_s):
                log.warning("decode worker %s: cutting off subscriber %s, too far behind",
                            self.worker_id, subscriber)
                outbox.cut_off()
                self.num_cut_off += 1
                self.metrics.on_subscriber_cut_off()
                self._drop_subscriber(subscriber, outbox.reader)

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, subscriber: str,
        resume_output: Sequence[int] = (), priority: int = 0,
    ) -> None:
        """Run the whole request here (colocated mode, or a stream migrated from a dead
        worker, ``resume_output`` being the tokens it had sent); deltas go to ``subscriber``.
        ``priority``: the request's place in the scheduler's order (lower goes first)."""
        await self.async_engine.call(
            self._submit, request_id, prompt_token_ids, params, subscriber, resume_output, priority
        )

    def _submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, subscriber: str,
        resume_output: Sequence[int], priority: int,
    ) -> None:
        # Added before it is routed: a refused id must not take over the route of the
        # request that holds it. (On the step thread: no step runs in between.)
        self.engine.add_request(
            prompt_token_ids, params, request_id=request_id, priority=priority, resume_output=resume_output
        )
        self.subscribers.route(request_id, subscriber)


class ColocatedWorker(DecodeWorker):
    """Both phases in one worker, no transfer: ``submit`` with a prompt."""

    role = "colocated"


TRANSFER_FAILED_MESSAGE = "the KV transfer failed and transfer.failure_policy is 'fail'"


def _wire(rid: str, items: list[RequestOutput | BaseException]) -> tuple[Any, ...]:
    """A request's outputs since its last message as one ``StreamDelta`` tuple."""
    for item in items:
        if isinstance(item, BaseException):
            return (rid, [], "", True, "error", 0, 0, 0, None,
                    f"the decode worker failed: {item}", ErrorKind.WORKER_FAILED.value, None)
    out = merge_outputs(cast(list[RequestOutput], items))  # none is an error
    lps = None
    if out.new_logprobs is not None:
        lps = [(lp.token_id, lp.logprob, list(lp.top)) for lp in out.new_logprobs]
    error = kind = None
    if out.finish_reason == "error":
        error, kind = TRANSFER_FAILED_MESSAGE, ErrorKind.TRANSFER_FAILED.value
    prompt_lps = None
    if out.prompt_logprobs is not None:
        prompt_lps = [
            None if lp is None else (lp.token_id, lp.logprob, lp.rank, list(lp.top)) for lp in out.prompt_logprobs
        ]
    return (rid, out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.num_prompt_tokens,
            out.num_output_tokens, out.num_cached_tokens, lps, error, kind, prompt_lps)
