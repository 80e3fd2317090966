"""Runs requests across the worker pools: placement, KV hand-off, streaming, re-runs.

A disaggregated request's way through the dispatcher::

    pick decode worker ─▶ reserve blocks ─▶ pick prefill worker ─▶ prefill (async)
        ─▶ stream deltas from the decode worker ─▶ finished / error / cancelled

This module is the asynchronous part: the attempt loop, its recovery, the load polls.
What it knows of each worker and the choices made from that are ``router.worker_loads``
(pure); the token streams and each request's inbox, ``router.streams``; its settings,
``router.dispatch_config``. A decode worker's step messages carry its load, so placement
polls only the workers this dispatcher hears nothing from, and only at placement.

Each placement of a request is an attempt, which the workers know by its own id
(``engine.wire.messages.attempt_id``: the client's id, this dispatcher's tag and a count):
nothing a worker still holds for an earlier attempt (a prefill finishing for a dead
reader, blocks kept for its transfer) is ever mistaken for the next one's, and a
dispatcher's aborts reach only its own attempts. A decode worker that cuts this
dispatcher off for reading too slowly ends those requests with an error (503).

Failures: a prefill worker that dies or fails the transfer makes the decode worker
apply its ``transfer.failure_policy`` at once. A decode worker that dies before any token
reached the client is retried on another worker (up to ``max_retries``). One that dies
after tokens were delivered has its stream moved (up to ``max_migrations``): a
prefill worker computes the KV of the prompt plus the tokens already sent (the
prompt's usually from its prefix cache), another decode worker takes it and goes on
from there (colocated, that decode worker recomputes them itself). Either way the dead
worker's attempt is aborted on the prefill workers first. The client sees one
unbroken stream: greedy output is unchanged, and a seeded request keeps its random
stream, which is indexed by output position. Past the bound the client gets an error
delta, never a silently cut stream.

Requests that share a prompt (the choices of a request with ``n`` > 1) share an
``Affinity`` (colocated: the decode worker that ran the prompt; disaggregated: the
prefill worker that computed it, and the decode worker that received it, so its KV is
sent once). Cancellation (the consumer stops iterating) aborts the request on both
workers, and so does ``abort(request_id)`` from another task (a gRPC Abort), which also
ends the stream with finish_reason "abort". With no prefill workers the decode workers
run requests whole (colocated).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import ParamSpec

from ray.exceptions import RayActorError

from engine.core.block_hash import BlockHasher
from engine.wire.clients import DecodeClient, PrefillClient, WorkerClient
from engine.wire.messages import (
    DecodeLoad,
    ErrorKind,
    PrefillLoad,
    Reservation,
    StalePlacement,
    StreamDelta,
    TransferState,
    WorkerRef,
    attempt_id,
)
from engine.wire.metrics import RouterMetrics
from engine.wire.sampling_params import SamplingParams
from router.dispatch_config import DispatchConfig
from router.streams import Abort, CutOff, Inbox, Subscriptions, WorkerDied, unless_ended
from router.worker_loads import Affinity, WorkerLoads

__all__ = ["Affinity", "DispatchConfig", "Dispatcher", "NoCapacityError", "WorkerRef", "aborted_delta"]

log = logging.getLogger(__name__)

P = ParamSpec("P")


class NoCapacityError(RuntimeError):
    """No decode worker had room for the request within ``capacity_wait_s``."""


class Dispatcher:
    """Runs requests over the prefill and decode pools (the module docstring says how). A router
    replica's ``RouterCore`` keeps one for its life (tests make their own, some over a
    ``TandemCluster``'s lists); it reads the worker lists through the callables it is given.
    ``close`` stops its streams."""

    def __init__(
        self,
        prefill_workers: Callable[[], Sequence[WorkerRef]],
        decode_workers: Callable[[], Sequence[WorkerRef]],
        config: DispatchConfig | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._prefill = prefill_workers
        self._decode = decode_workers
        self.config = config or DispatchConfig()
        self.metrics = metrics
        self.num_migrations = 0
        self.num_stale_placements = 0  # placements and load polls refused by a worker that switched roles
        self.num_local_prefills: Counter[str] = Counter()  # requests computed by their decode worker, by reason
        self.loads = WorkerLoads(self.config)  # reports, pending placements, prefix indexes; event-loop time
        self._polls: dict[str, asyncio.Future[None]] = {}  # worker key -> its latest load poll
        self._ids = itertools.count()
        self._refreshing: asyncio.Future[None] | None = None
        self._inflight: dict[str, Inbox] = {}  # request id -> where its deltas (and abort) arrive
        self._hasher = BlockHasher(self.config.prefix_hash_algo, self.config.prefix_hash_seed)
        self._tag = uuid.uuid4().hex[:12]  # in every attempt id: unique to this dispatcher
        self._attempts = itertools.count()
        self.subscriptions = Subscriptions(
            f"router-{self._tag}", self._note_load, self.config.channel,
            (lambda event: None) if metrics is None else metrics.on_stream_event,
        )

    # -- load reports ----------------------------------------------------------

    async def refresh_loads(self, workers: Sequence[WorkerRef] | None = None) -> None:
        """Ask ``workers`` (default: every one) for their load now. One poll runs at a
        time; callers that come meanwhile share it."""
        if self._refreshing is not None and not self._refreshing.done():
            return await asyncio.shield(self._refreshing)
        workers = [*self._prefill(), *self._decode()] if workers is None else workers
        self._refreshing = asyncio.ensure_future(self._refresh(workers))
        await asyncio.shield(self._refreshing)

    async def _refresh(self, workers: Sequence[WorkerRef]) -> None:
        """Poll ``workers``, waiting at most ``channel.heartbeat_timeout_s``: a worker
        silent that long (hung, stopped) has its load forgotten, so nothing is placed on
        it, and is not asked again until that poll answers (its answer counts then)."""
        polls = [self._poll(w) for w in workers]
        _, unanswered = await asyncio.wait(polls, timeout=self.config.channel.heartbeat_timeout_s)
        for w, poll in zip(workers, polls):
            if poll in unanswered:
                self.loads.forget(w.worker_id)

    def _poll(self, worker: WorkerRef) -> asyncio.Future[None]:
        poll = self._polls.get(worker.key)
        if poll is None or poll.done():
            poll = self._polls[worker.key] = asyncio.ensure_future(self._ask_load(worker))
        return poll

    async def _ask_load(self, worker: WorkerRef) -> None:
        try:
            load = await WorkerClient.of(worker).load()
        except StalePlacement as e:  # it switched roles: nothing goes there by this list
            self._stale(worker, e)
        except Exception:  # gone or broken: not placeable for now
            self.loads.forget(worker.worker_id)
        else:
            self._note_load(worker.worker_id, load)

    def _note_load(self, worker_id: str, load: PrefillLoad | DecodeLoad) -> None:
        self.loads.note(worker_id, load, asyncio.get_running_loop().time())

    async def _fresh_loads(self) -> None:
        """Load reports no older than ``load_poll_s``. Decode workers streaming to this
        dispatcher report with every step; the rest are asked, at placement only (an
        idle router sends no polls: polling every 50 ms cost more CPU than the tokens)."""
        now = asyncio.get_running_loop().time()
        stale = [
            w for w in self.loads.stale((*self._prefill(), *self._decode()), now)
            if w.key not in self._polls or self._polls[w.key].done()  # one unanswered poll at a time
        ]
        if stale:
            await self.refresh_loads(stale)

    def close(self) -> None:
        """Stop reading the decode workers' streams."""
        self.subscriptions.stop()

    # -- placement -------------------------------------------------------------

    def prefix_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, as the prefix indexes key them;
        none when placement ignores prefixes."""
        if self.config.placement == "round_robin" or not self.config.prefix_affinity:
            return []
        return self._hasher.hash_blocks(prompt, self.config.block_size)

    def _choose_decode(
        self, blocks: int, exclude: set[str], affinity: Affinity | None = None, hashes: Sequence[bytes] = (),
    ) -> tuple[WorkerRef, int] | None:
        """A decode worker with room, and how many of the prompt's leading blocks it likely
        caches (``WorkerLoads.choose_decode``)."""
        return self.loads.choose_decode(self._decode(), blocks, exclude, affinity, hashes)

    def _choose_prefill(
        self, prompt: list[int], affinity: Affinity | None = None, hashes: Sequence[bytes] | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> WorkerRef | None:
        """The prefill worker for ``prompt`` (``WorkerLoads.choose_prefill``). ``hashes``: the
        prompt's ``prefix_hashes`` when the caller has them already."""
        hashes = self.prefix_hashes(prompt) if hashes is None else hashes
        return self.loads.choose_prefill(self._prefill(), len(prompt), hashes, affinity, exclude)

    # -- requests --------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        affinity: Affinity | None = None, priority: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """Stream the request's deltas; the last one is finished (or carries an error).

        ``abort(request_id)`` from any task ends the stream with finish_reason "abort".
        ``affinity``: shared by requests of one prompt, to place them where its blocks are.
        ``priority``: the engines' scheduling priority on both workers (lower goes first).
        """
        rid = request_id or f"d{next(self._ids)}"
        if rid in self._inflight:
            yield StreamDelta.failure(rid, ErrorKind.INVALID, f"request_id {rid!r} is already in flight")
            return
        inbox = self._inflight[rid] = Inbox(rid)
        try:
            async for delta in self._run(rid, prompt_token_ids, params, inbox, affinity, priority):
                yield delta
        finally:
            del self._inflight[rid]

    def in_flight(self, request_id: str) -> bool:
        """Whether ``request_id`` runs on this dispatcher now."""
        return request_id in self._inflight

    def abort(self, request_id: str) -> bool:
        """Abort a request: its blocks are freed on every worker and its stream ends.

        Returns whether the request was in flight on this dispatcher.
        """
        inbox = self._inflight.get(request_id)
        if inbox is None:
            # Not ours (another router replica runs it): every attempt of that id, anywhere.
            for w in [*self._prefill(), *self._decode()]:
                _quietly(WorkerClient.of(w).abort_request, request_id)
        else:
            inbox.put(Abort.REQUESTED)  # its stream's task aborts it everywhere
        return inbox is not None

    async def _run(
        self, rid: str, prompt: list[int], params: SamplingParams, inbox: Inbox, affinity: Affinity | None,
        priority: int,
    ) -> AsyncIterator[StreamDelta]:
        sent: list[int] = []  # tokens that reached the client
        failed: set[str] = set()  # worker keys this request died on
        tries: Counter[str] = Counter()  # "reruns" (died before any token) and "migrations" (after)
        while True:
            blocks = -(-(len(prompt) + len(sent) + 1) // self.config.block_size)
            aid = attempt_id(rid, self._tag, next(self._attempts))  # what the workers call it
            try:
                decode = await self._start(aid, prompt, params, blocks, failed, inbox, sent, affinity, priority)
            except NoCapacityError as e:
                yield StreamDelta.failure(rid, ErrorKind.NO_CAPACITY, str(e))
                return
            except BaseException:
                # Cancelled while placing: a reservation may already hold blocks.
                self._abort_everywhere(aid)
                raise
            try:
                while True:
                    item = await inbox.get()
                    if item is Abort.REQUESTED:
                        self._abort_everywhere(aid)
                        yield aborted_delta(rid, len(prompt), len(sent))
                        return
                    if isinstance(item, WorkerDied):
                        raise item
                    if isinstance(item, CutOff):
                        self._abort_everywhere(aid)
                        yield StreamDelta.failure(rid, ErrorKind.NO_CAPACITY, f"the router fell behind: {item}")
                        return
                    sent += item.token_ids
                    if item.finished:
                        break
                    yield item
            except (WorkerDied, RayActorError):
                self._decode_died(decode, failed)
                # Its prefill may still run or hold blocks for the dead reader: end it
                # now, rather than when its transfer fails.
                for w in self._prefill():
                    _quietly(WorkerClient.of(w).abort, aid)
            except BaseException:
                # Cancelled (client gone) or failed: free the request's blocks everywhere.
                self._abort_everywhere(aid)
                raise
            else:
                # The request is over on every worker: a consumer that stops here (the
                # stream closed at its last delta) has nothing left to abort.
                yield item
                return
            finally:
                self.subscriptions.close(decode, aid)
            if (failure := self._next_attempt(rid, decode, sent, tries)) is not None:
                yield failure
                return

    def _decode_died(self, decode: WorkerRef, exclude: set[str]) -> None:
        """``decode`` is gone: place nothing there again, and forget what it held."""
        exclude.add(decode.key)
        self.loads.decode_gone(decode)

    def _next_attempt(self, rid: str, decode: WorkerRef, sent: list[int], tries: Counter[str]) -> StreamDelta | None:
        """After ``decode`` died under the request: count a migration (tokens had reached
        the client) or a re-run; the request's failure once past its bound, else None."""
        if sent:
            tries["migrations"] += 1
            if tries["migrations"] > self.config.max_migrations:
                return StreamDelta.failure(
                    rid, ErrorKind.WORKER_FAILED,
                    f"decode worker {decode.worker_id} died after {len(sent)} tokens were sent, and the "
                    f"stream had already moved {self.config.max_migrations} times (max_migrations)",
                )
            log.warning("decode worker %s died; moving %s on after %d tokens", decode.worker_id, rid, len(sent))
            self.num_migrations += 1
            if self.metrics is not None:
                self.metrics.on_migrated()
            return None
        tries["reruns"] += 1
        if tries["reruns"] > self.config.max_retries:
            return StreamDelta.failure(
                rid, ErrorKind.WORKER_FAILED, f"request failed after {tries['reruns']} attempts (max_retries)"
            )
        log.warning("decode worker %s died; re-running %s (attempt %d)", decode.worker_id, rid, tries["reruns"] + 1)
        return None

    async def _start(
        self, aid: str, prompt: list[int], params: SamplingParams, blocks: int, exclude: set[str], inbox: Inbox,
        resume: list[int], affinity: Affinity | None, priority: int,
    ) -> WorkerRef:
        """Place attempt ``aid`` of a request on a decode worker, its deltas routed to ``inbox``.

        ``resume``: tokens already streamed (a migrated request). A prefill worker computes
        their KV with the prompt's (its prefix cache usually holds the prompt) and the
        decode worker goes on after them; with no prefill workers, the decode worker
        recomputes them itself. Waits (bounded) for KV room.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.capacity_wait_s
        # A decode worker's prefix cache holds a prompt's blocks once a request of it ran there or its
        # KV came (then only the blocks after them are sent): requests go there, if not much busier.
        hashes = self.prefix_hashes(prompt)
        while True:
            await self._fresh_loads()
            chosen = self._choose_decode(blocks, exclude, affinity, hashes)
            if chosen is not None:
                decode, held = chosen
                local = None if resume else self._prefill_here(prompt, held, decode)
                subscriber = self.subscriptions.open(decode, aid, inbox)
                client = DecodeClient.of(decode)
                try:
                    if not self._prefill() or local:
                        await unless_ended(self.subscriptions.reader(decode), client.submit(
                            aid, prompt, params, subscriber=subscriber, resume_output=list(resume), priority=priority))
                        self._count_local(local)
                        return decode
                    reservation = await unless_ended(self.subscriptions.reader(decode), client.reserve(
                        aid, prompt, params, subscriber=subscriber, resume_output=list(resume), priority=priority))
                except StalePlacement as e:  # it switched roles since our list was made: nothing was taken
                    self._stale(decode, e, aid, exclude)
                    continue
                except (RayActorError, WorkerDied):
                    # Died (or its stream did: hung) before taking the request: place it
                    # elsewhere. A hung worker that wakes up frees what the call took.
                    self.subscriptions.close(decode, aid)
                    inbox.drop_ended_streams()
                    self._decode_died(decode, exclude)
                    _quietly(client.abort, aid)
                    continue
                except BaseException:
                    self.subscriptions.close(decode, aid)
                    raise
                finally:
                    # From here the worker's own load reports count the request.
                    self.loads.decode_answered(decode.worker_id, blocks)
                if reservation is not None:
                    self._start_prefill(
                        aid, prompt, params, decode, reservation, list(resume), affinity, priority,
                        None if resume else hashes,  # a migration's prefill prompt is longer
                    )
                    return decode
                self.subscriptions.close(decode, aid)
            if loop.time() > deadline:
                raise NoCapacityError(f"no decode worker had room for {blocks} KV blocks within "
                                      f"{self.config.capacity_wait_s}s")
            await asyncio.sleep(self.config.load_poll_s)

    def _prefill_here(self, prompt: list[int], held_blocks: int, decode: WorkerRef) -> str | None:
        """Why ``decode`` should compute this prompt itself (``WorkerLoads.prefill_here``), or None."""
        return self.loads.prefill_here(self._prefill(), len(prompt), held_blocks, decode.worker_id)

    def _count_local(self, reason: str | None) -> None:
        if reason is not None:
            self.num_local_prefills[reason] += 1
            if self.metrics is not None:
                self.metrics.on_local_prefill(reason)

    def _stale(
        self, worker: WorkerRef, e: StalePlacement, aid: str | None = None, exclude: set[str] | None = None,
    ) -> None:
        """``worker`` refused a placement as stale: count it and forget its load until the
        next worker list says what it is now; a decode worker's refusal of attempt ``aid``
        also closes its route there and keeps the attempt's next choice off it (``exclude``)."""
        log.info("worker %s refused a stale placement (%s); placing elsewhere", worker.worker_id, e)
        self.num_stale_placements += 1
        self.loads.forget(worker.worker_id)
        if aid is not None:
            self.subscriptions.close(worker, aid)
        if exclude is not None:
            exclude.add(worker.key)

    def _start_prefill(
        self, aid: str, prompt: list[int], params: SamplingParams, decode: WorkerRef, reservation: Reservation,
        resume: list[int], affinity: Affinity | None, priority: int, hashes: Sequence[bytes] | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> None:
        """Prefill attempt ``aid`` on a prefill worker, its KV to go to ``decode``'s
        ``reservation``; the task watching it tells ``decode`` at once if the KV will not come."""
        prefill = self._choose_prefill(prompt + resume, affinity, hashes, exclude)
        reader = DecodeClient.of(decode)
        if prefill is None:
            reader.transfer_failed(aid)  # no prefill worker: policy decides
            return
        ref = PrefillClient.of(prefill).prefill(
            aid, prompt, params, decode_worker=decode.handle, reservation=reservation, resume_output=resume,
            priority=priority)

        async def watch() -> None:
            try:
                result = await ref
            except StalePlacement as e:  # refused untouched: the reservation waits for another
                self._stale(prefill, e)
                self._start_prefill(aid, prompt, params, decode, reservation, resume, None, priority, hashes,
                                    exclude | {prefill.key})
            except Exception as e:
                # The prefill worker died or broke: don't make the decode side wait out the deadline.
                self.loads.prefill_gone(prefill.worker_id)
                reader.transfer_failed(aid)
                if isinstance(e, RayActorError):  # its memory is gone: no read from it can still land
                    _quietly(reader.sender_gone, prefill.worker_id)
            else:
                if result.state != TransferState.DONE:  # the KV will not come: its reader need not wait for it
                    reader.transfer_failed(aid)  # (told twice, it ignores the second)
            finally:
                self.loads.prefill_ended(prefill.worker_id, len(prompt) + len(resume))

        asyncio.get_running_loop().create_task(watch())

    def _abort_everywhere(self, aid: str) -> None:
        """Abort attempt ``aid`` on every worker."""
        for w in [*self._prefill(), *self._decode()]:
            _quietly(WorkerClient.of(w).abort, aid)


def _quietly(call: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
    """Make a fire-and-forget call whose failure changes nothing."""
    try:
        call(*args, **kwargs)
    except Exception:  # a dead worker has nothing left to free
        pass


def aborted_delta(rid: str, num_prompt_tokens: int, num_output_tokens: int) -> StreamDelta:
    """The last delta of a request aborted after ``num_output_tokens`` tokens."""
    return StreamDelta(request_id=rid, token_ids=[], text="", finished=True, finish_reason="abort",
                       num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens)
