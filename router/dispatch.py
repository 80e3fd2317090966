"""Runs requests across the worker pools: placement, KV hand-off, streaming, re-runs.

A disaggregated request's way through the dispatcher::

    pick decode worker ─▶ reserve blocks ─▶ pick prefill worker ─▶ prefill (async)
        ─▶ stream deltas from the decode worker ─▶ finished / error / cancelled

Tokens come back over one stream per decode worker (``Subscriptions``: the worker's
token channel, a TCP connection, or where that cannot be reached its Ray ``subscribe``):
each message holds one engine step's deltas for all of this dispatcher's requests on
that worker, which the dispatcher hands to each request's ``Inbox``. So the
messages per step do not grow with the batch, and an abort is just one more item in
the request's inbox. Each message also carries the worker's load after the step, so
placement polls only the workers this dispatcher hears nothing from (prefill workers,
idle decode workers), and only at placement.

Each placement of a request is an attempt, which the workers know by its own id
(``engine.messages.attempt_id``: the client's id, this dispatcher's tag and a count):
nothing a worker still holds for an earlier attempt (a prefill finishing for a dead
reader, blocks kept for its transfer) is ever mistaken for the next one's, and a
dispatcher's aborts reach only its own attempts.

The token channel reconnects on its own after a network blip (the worker keeps the
stream for ``channel.reconnect_grace_s``, and no delta is lost or doubled), so only a
channel that cannot be resumed counts as the worker's death. A worker that finds this
dispatcher too slow to read its stream tells it (logged, counted), then cuts it off:
those requests end with an error (503), since placing them again would not make the
reader faster.

Failures: a prefill worker that dies or fails the transfer makes the decode worker
apply its ``transfer.failure_policy`` at once. A decode worker that dies before any token
reached the client is retried on another worker (up to ``max_retries``). One that dies
after tokens were delivered has its stream moved (up to ``max_migrations``): a
prefill worker computes the KV of the prompt plus the tokens already sent (the
prompt's usually from its prefix cache), another decode worker takes it and goes on
from there (colocated, that decode worker recomputes them itself). Either way the dead
worker's attempt is aborted on the prefill workers first. The client sees one
unbroken stream: greedy output is unchanged, and a seeded request keeps its random
stream, which is indexed by output position. Past
the bound the client gets an error delta, never a silently cut stream.
Requests that share a prompt (the choices of a request with ``n`` > 1) share an
``Affinity``: the first one placed records its workers, and the others go to the same
ones while those have room, so their prompt's blocks come from the prefix caches
(colocated: the decode worker that ran the prompt; disaggregated: the prefill worker
that computed it, and the decode worker that received it, so its KV is sent once).
Cancellation (the consumer stops iterating) aborts the request on both workers, and so
does ``abort(request_id)`` from another task (a gRPC Abort), which also ends the stream
with finish_reason "abort".
With no prefill workers the decode workers run requests whole (colocated).
Beyond affinities, a request goes to the decode worker that was last sent its prompt's
leading blocks (its prefix cache likely holds them: colocated, they are not computed
again; disaggregated, they are not sent again) unless that worker is much busier.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from ray.exceptions import RayActorError

from engine import token_channel
from engine.block_hash import DEFAULT_HASH_ALGO, BlockHasher, check_hash_algo, check_hash_seed
from engine.messages import ErrorKind, StalePlacement, StreamDelta, TransferState, WorkerRef, attempt_id
from engine.sampling_params import SamplingParams
from engine.token_channel import ChannelConfig, Notice, NoticeKind
from router.placement import (
    PrefixIndex,
    decode_has_room,
    pick_affine,
    pick_decode,
    pick_prefill,
    prefill_here,
    round_robin,
)

PLACEMENTS = ("load", "round_robin")

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """The decode worker's subscription stream broke: the worker is gone."""


class CutOff(RuntimeError):
    """The decode worker dropped this dispatcher's stream for falling behind; its
    requests there were aborted."""


_ABORTED = object()


class Inbox:
    """One request's deltas as the subscription delivers them (a minimal async queue).

    Workers know the request by its attempt's id; its deltas go out under
    ``request_id``, the client's."""

    __slots__ = ("_items", "_waiter", "request_id")

    def __init__(self, request_id: str = "") -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self.request_id = request_id

    def put(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def drop_ended_streams(self) -> None:
        """Forget the ends of streams (``WorkerDied``, ``CutOff``) that came while the
        request was being placed on a worker it then left, so they do not end the next attempt."""
        self._items = deque(i for i in self._items if not isinstance(i, (WorkerDied, CutOff)))

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class Subscriptions:
    """This dispatcher's stream from each decode worker, and who waits on it.

    A stream is opened on the first request to a worker and kept; each message (one
    engine step's deltas) is fanned out to the requests' inboxes. When the stream
    breaks (the worker died) every request still registered on it gets ``WorkerDied``.
    Every stream has its own subscriber name, so a stream opened anew (after a death,
    or from another event loop) never shares a worker-side outbox with an old one.
    """

    def __init__(
        self, name: str, on_load: Callable[[str, object], None] = lambda worker_id, load: None,
        channel: ChannelConfig | None = None, on_event: Callable[[str], None] = lambda event: None,
    ) -> None:
        self.name = name
        self._on_load = on_load  # (worker id, DecodeLoad) from each step message
        self.channel = channel or ChannelConfig()
        self._on_event = on_event  # a ``NoticeKind`` value, for each ``Notice`` a stream brings
        self._streams = itertools.count()
        self._inboxes: dict[str, dict[str, Inbox]] = {}  # worker key -> request id -> inbox
        self._readers: dict[str, tuple[asyncio.Task, str]] = {}  # worker key -> (reader, subscriber)

    def open(self, worker: WorkerRef, request_id: str, inbox: Inbox) -> str:
        """Register a request (by the id the worker knows it by: its attempt's) before it
        is sent to ``worker``; starts the stream if needed.

        Returns the subscriber name to route the request to.
        """
        self._inboxes.setdefault(worker.key, {})[request_id] = inbox
        reader = self._readers.get(worker.key)
        if reader is None or reader[0].done():
            subscriber = f"{self.name}-{next(self._streams)}"
            task = asyncio.get_running_loop().create_task(self._read(worker, subscriber))
            reader = self._readers[worker.key] = (task, subscriber)
        return reader[1]

    def reader(self, worker: WorkerRef) -> asyncio.Task:
        """The task reading ``worker``'s stream (``open`` started it): done when the stream ended."""
        return self._readers[worker.key][0]

    def close(self, worker: WorkerRef, request_id: str) -> None:
        inboxes = self._inboxes.get(worker.key)
        if inboxes is not None:
            inboxes.pop(request_id, None)

    async def _read(self, worker: WorkerRef, subscriber: str) -> None:
        inboxes = self._inboxes[worker.key]
        make = StreamDelta._make
        error: BaseException = WorkerDied(f"decode worker {worker.worker_id} ended its stream")
        try:
            async with aclosing(self._messages(worker, subscriber)) as messages:
                async for message in messages:
                    if type(message) is Notice:
                        if self._noticed(worker, message):
                            error = CutOff(message.detail)
                            break
                        continue
                    load, items = message
                    if load is not None:
                        self._on_load(worker.worker_id, load)
                    for item in items:
                        inbox = inboxes.get(item[0])
                        if inbox is not None:
                            inbox.put(make((inbox.request_id, *item[1:])))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # RayActorError, or the channel's connection ended: the worker is gone
            error = WorkerDied(f"decode worker {worker.worker_id} died: {type(e).__name__}")
        finally:
            self._readers.pop(worker.key, None)
            dropped = self._inboxes.pop(worker.key, {})
            for inbox in dropped.values():
                inbox.put(error)

    def _noticed(self, worker: WorkerRef, notice: Notice) -> bool:
        """Log and count a stream's notice; whether it ends the stream (cut off)."""
        self._on_event(notice.kind.value)
        if notice.kind is NoticeKind.RESUMED:
            log.info("token channel of decode worker %s reconnected %s", worker.worker_id, notice.detail)
        else:
            log.warning("decode worker %s: %s", worker.worker_id, notice.detail)
        return notice.kind is NoticeKind.CUT

    async def _messages(self, worker: WorkerRef, subscriber: str) -> AsyncIterator:
        """The worker's step messages for ``subscriber``: over its token channel when it
        has one this process can reach, else over Ray (``subscribe``)."""
        ask = getattr(worker.handle, "token_channel", None)
        # A worker that does not answer within the channel's deadline is hung: its stream ends.
        address = None if ask is None else await asyncio.wait_for(ask.remote(), self.channel.heartbeat_timeout_s)
        if address is not None:
            try:
                messages = await token_channel.connect(address, subscriber, self.channel)
            except OSError as e:
                log.warning("cannot reach decode worker %s's token channel at %s:%d (%s); streaming over Ray",
                            worker.worker_id, address.host, address.port, e)
            else:
                async with aclosing(messages):
                    async for message in messages:
                        yield message
                return
        async for ref in worker.handle.subscribe.options(num_returns="streaming").remote(subscriber):
            yield await ref

    def stop(self) -> None:
        for task, _ in self._readers.values():
            task.cancel()


@dataclass(frozen=True)
class DispatchConfig:
    """The dispatcher's settings: placement and its limits, re-runs and migrations, local prefill
    rules, the prefix hash and the token channel; checked on creation. Block size and the running
    cap come from the cluster (``dispatch_settings``), to match the engines."""

    block_size: int = 16
    max_running_per_decode: int = 256
    max_retries: int = 2  # re-runs of a request whose decode worker died before any token
    max_migrations: int = 3  # moves of a stream whose decode worker died after tokens were sent
    capacity_wait_s: float = 30.0  # how long a request may wait for KV room
    load_poll_s: float = 0.05  # placement uses load reports at most this old
    placement: str = "load"  # "load": the load-aware policies; "round_robin": the baseline
    prefix_affinity: bool = True
    max_imbalance_tokens: int = 4096  # how much busier an affine prefill worker may be
    max_imbalance_requests: int = 8  # how many more requests an affine decode worker may run
    # Per-request disaggregation (placement.prefill_here; 0 turns a rule off): a prompt with
    # at most this many tokens missing from its decode worker's prefix cache is computed there...
    local_prefill_tokens: int = 0
    # ...and so is any prompt while every prefill worker has this many tokens queued.
    local_prefill_backlog_tokens: int = 0
    # The prompt hashes of the prefix indexes (engine.block_hash). They need not match
    # the engines' (each side compares only its own), but one setting names both.
    prefix_hash_algo: str = DEFAULT_HASH_ALGO
    prefix_hash_seed: str | int | None = None  # None: a random one per dispatcher
    # The token channel's heartbeats and reconnect grace (the workers get the same settings).
    channel: ChannelConfig = field(default_factory=ChannelConfig)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        for name in ("local_prefill_tokens", "local_prefill_backlog_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        check_hash_algo(self.prefix_hash_algo)
        check_hash_seed(self.prefix_hash_seed)


@dataclass
class Affinity:
    """Where requests sharing a prompt go: the workers of the first one placed."""

    decode: str | None = None  # worker key: colocated, the decode worker holds the prompt's blocks
    prefill: str | None = None  # worker id: disaggregated, the prefill worker does


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
        metrics=None,
    ) -> None:
        self._prefill = prefill_workers
        self._decode = decode_workers
        self.config = config or DispatchConfig()
        self.metrics = metrics  # an ``engine.metrics.RouterMetrics``, or None
        self.num_migrations = 0
        self.num_stale_placements = 0  # placements and load polls refused by a worker that switched roles
        self.num_local_prefills: Counter = Counter()  # requests computed by their decode worker, by reason
        self._loads: dict[str, object] = {}  # worker id -> its latest load report
        self._load_times: dict[str, float] = {}  # worker id -> event-loop time of that report
        self._polls: dict[str, asyncio.Future] = {}  # worker key -> its latest load poll
        self._pending_blocks: dict[str, int] = {}
        self._pending_tokens: dict[str, int] = {}
        self._ids = itertools.count()
        self._decode_ties = itertools.count()  # separate counters, so ties rotate within each pool
        self._prefill_ties = itertools.count()
        self._refreshing: asyncio.Future | None = None
        self._inflight: dict[str, Inbox] = {}  # request id -> where its deltas (and abort) arrive
        self._prefixes = PrefixIndex()  # prefill workers' prompts, by worker id
        self._decode_prefixes = PrefixIndex()  # decode workers' prompts, by incarnation
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
                self._forget_load(w.worker_id)

    def _poll(self, worker: WorkerRef) -> asyncio.Future:
        poll = self._polls.get(worker.key)
        if poll is None or poll.done():
            poll = self._polls[worker.key] = asyncio.ensure_future(self._ask_load(worker))
        return poll

    async def _ask_load(self, worker: WorkerRef) -> None:
        try:
            load = await worker.handle.load.remote(**worker.fence())
        except StalePlacement as e:  # it switched roles: nothing goes there by this list
            self._stale(worker, e)
        except Exception:  # gone or broken: not placeable for now
            self._forget_load(worker.worker_id)
        else:
            self._note_load(worker.worker_id, load)

    def _note_load(self, worker_id: str, load) -> None:
        self._loads[worker_id] = load
        self._load_times[worker_id] = asyncio.get_running_loop().time()

    def _forget_load(self, worker_id: str) -> None:
        self._loads.pop(worker_id, None)
        self._load_times.pop(worker_id, None)

    async def _fresh_loads(self) -> None:
        """Load reports no older than ``load_poll_s``. Decode workers streaming to this
        dispatcher report with every step; the rest are asked, at placement only (an
        idle router sends no polls: polling every 50 ms cost more CPU than the tokens)."""
        now, limit = asyncio.get_running_loop().time(), self.config.load_poll_s
        stale = [
            w for w in (*self._prefill(), *self._decode())
            if now - self._load_times.get(w.worker_id, -math.inf) > limit
            and (w.key not in self._polls or self._polls[w.key].done())  # one unanswered poll at a time
        ]
        if stale:
            await self.refresh_loads(stale)

    def close(self) -> None:
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
        caches; with an ``affinity``, its worker first. ``hashes``: the prompt's block
        hashes, to prefer a worker whose prefix cache holds its start."""
        workers = [
            w for w in self._decode() if w.worker_id in self._loads and w.key not in exclude and not w.draining
        ]
        loads = [self._loads[w.worker_id] for w in workers]
        pending = [self._pending_blocks.get(w.worker_id, 0) for w in workers]
        cap = self.config.max_running_per_decode
        room = [decode_has_room(load, blocks, cap, p) for load, p in zip(loads, pending)]
        i = None if affinity is None else pick_affine([w.key for w in workers], affinity.decode, room)
        if i is None and self.config.placement == "round_robin":
            i = round_robin(len(workers), next(self._decode_ties), room)
        elif i is None:
            cached = [self._decode_prefixes.matched_blocks(w.key, hashes) for w in workers] if hashes else ()
            i = pick_decode(loads, blocks, cap, pending, next(self._decode_ties), cached,
                            self.config.max_imbalance_requests)
        if i is None:
            return None
        if affinity is not None and affinity.decode is None:
            affinity.decode = workers[i].key
        self._pending_blocks[workers[i].worker_id] = pending[i] + blocks
        held = self._decode_prefixes.matched_blocks(workers[i].key, hashes) if hashes else 0
        if hashes:
            self._decode_prefixes.record(workers[i].key, hashes)
        return workers[i], held

    def _choose_prefill(
        self, prompt: list[int], affinity: Affinity | None = None, hashes: Sequence[bytes] | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> WorkerRef | None:
        """The prefill worker for ``prompt``; with an ``affinity``, its worker first.
        ``hashes``: the prompt's ``prefix_hashes`` when the caller has them already;
        ``exclude``: the keys of workers not to choose."""
        workers = [w for w in self._prefill()
                   if w.worker_id in self._loads and not w.draining and w.key not in exclude]
        loads = [self._loads[w.worker_id] for w in workers]
        pending = [self._pending_tokens.get(w.worker_id, 0) for w in workers]
        load_aware = self.config.placement != "round_robin"
        if hashes is None:
            hashes = self.prefix_hashes(prompt)
        i = None if affinity is None else pick_affine([w.worker_id for w in workers], affinity.prefill)
        if i is None and not load_aware:
            i = round_robin(len(workers), next(self._prefill_ties))
        elif i is None:
            cached = [self._prefixes.matched_blocks(w.worker_id, hashes) * self.config.block_size for w in workers]
            i = pick_prefill(loads, pending, next(self._prefill_ties), cached, self.config.max_imbalance_tokens)
        if i is None:
            return None
        if affinity is not None and affinity.prefill is None:
            affinity.prefill = workers[i].worker_id
        self._pending_tokens[workers[i].worker_id] = pending[i] + len(prompt)
        self._prefixes.record(workers[i].worker_id, hashes)
        return workers[i]

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
        return request_id in self._inflight

    def abort(self, request_id: str) -> bool:
        """Abort a request: its blocks are freed on every worker and its stream ends.

        Returns whether the request was in flight on this dispatcher.
        """
        inbox = self._inflight.get(request_id)
        if inbox is None:
            # Not ours (another router replica runs it): every attempt of that id, anywhere.
            for w in [*self._prefill(), *self._decode()]:
                _quietly(w.handle.abort_request.remote, request_id)
        else:
            inbox.put(_ABORTED)  # its stream's task aborts it everywhere
        return inbox is not None

    async def _run(
        self, rid, prompt, params, inbox: Inbox, affinity: Affinity | None, priority: int
    ) -> AsyncIterator[StreamDelta]:
        sent: list[int] = []  # tokens that reached the client
        failed: set[str] = set()  # worker keys this request died on
        tries = Counter()  # "reruns" (died before any token) and "migrations" (after)
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
                    if item is _ABORTED:
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
                    _quietly(w.handle.abort.remote, aid)
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
        self._forget_load(decode.worker_id)
        self._decode_prefixes.forget(decode.key)

    def _next_attempt(self, rid: str, decode: WorkerRef, sent: list[int], tries: Counter) -> StreamDelta | None:
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
        self, aid, prompt, params, blocks, exclude, inbox: Inbox, resume: list[int], affinity: Affinity | None,
        priority: int,
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
                reading = self.subscriptions.reader(decode)
                try:
                    if not self._prefill() or local:
                        await _unless_ended(reading, decode.handle.submit.remote(
                            aid, prompt, params, subscriber, list(resume), priority, **decode.fence()))
                        self._count_local(local)
                        return decode
                    reservation = await _unless_ended(reading, decode.handle.reserve.remote(
                        aid, prompt, params, subscriber, list(resume), priority, **decode.fence()))
                except StalePlacement as e:  # it switched roles since our list was made: nothing was taken
                    self._stale(decode, e, aid, exclude)
                    continue
                except (RayActorError, WorkerDied):
                    # Died (or its stream did: hung) before taking the request: place it
                    # elsewhere. A hung worker that wakes up frees what the call took.
                    self.subscriptions.close(decode, aid)
                    inbox.drop_ended_streams()
                    self._decode_died(decode, exclude)
                    _quietly(decode.handle.abort.remote, aid)
                    continue
                except BaseException:
                    self.subscriptions.close(decode, aid)
                    raise
                finally:
                    # From here the worker's own load reports count the request.
                    self._pending_blocks[decode.worker_id] -= blocks
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
        """Why ``decode`` should compute this prompt itself (``placement.prefill_here``),
        or None; never without prefill workers or with both rules off."""
        cfg = self.config
        if not (cfg.local_prefill_tokens or cfg.local_prefill_backlog_tokens) or not self._prefill():
            return None
        queues = [
            self._loads[w.worker_id].queued_prefill_tokens + self._pending_tokens.get(w.worker_id, 0)
            for w in self._prefill() if w.worker_id in self._loads and not w.draining
        ]
        uncached = len(prompt) - min(held_blocks * cfg.block_size, len(prompt))
        return prefill_here(uncached, queues, self._loads[decode.worker_id], cfg.local_prefill_tokens,
                            cfg.local_prefill_backlog_tokens)

    def _count_local(self, reason: str | None) -> None:
        if reason is not None:
            self.num_local_prefills[reason] += 1
            if self.metrics is not None:
                self.metrics.on_local_prefill(reason)

    def _stale(self, worker: WorkerRef, e: StalePlacement, aid: str | None = None, exclude: set | None = None) -> None:
        """``worker`` refused a placement as stale: count it and forget its load until the
        next worker list says what it is now; a decode worker's refusal of attempt ``aid``
        also closes its route there and keeps the attempt's next choice off it (``exclude``)."""
        log.info("worker %s refused a stale placement (%s); placing elsewhere", worker.worker_id, e)
        self.num_stale_placements += 1
        self._forget_load(worker.worker_id)
        if aid is not None:
            self.subscriptions.close(worker, aid)
            exclude.add(worker.key)

    def _start_prefill(
        self, aid, prompt, params, decode: WorkerRef, reservation, resume: list[int], affinity: Affinity | None,
        priority: int, hashes: Sequence[bytes] | None = None, exclude: frozenset[str] = frozenset(),
    ) -> None:
        prefill = self._choose_prefill(prompt + resume, affinity, hashes, exclude)
        if prefill is None:
            decode.handle.transfer_failed.remote(aid)  # no prefill worker: policy decides
            return
        ref = prefill.handle.prefill.remote(
            aid, prompt, params, decode.handle, reservation, resume, priority, **prefill.fence())

        async def watch() -> None:
            try:
                result = await ref
            except StalePlacement as e:  # refused untouched: the reservation waits for another
                self._stale(prefill, e)
                self._start_prefill(aid, prompt, params, decode, reservation, resume, None, priority, hashes,
                                    exclude | {prefill.key})
            except Exception as e:
                # The prefill worker died or broke: don't make the decode side wait out the deadline.
                self._forget_load(prefill.worker_id)
                self._prefixes.forget(prefill.worker_id)
                decode.handle.transfer_failed.remote(aid)
                if isinstance(e, RayActorError):  # its memory is gone: no read from it can still land
                    _quietly(lambda: decode.handle.sender_gone.remote(prefill.worker_id))
            else:
                if result.state != TransferState.DONE:  # the KV will not come: its reader need not wait for it
                    decode.handle.transfer_failed.remote(aid)  # (told twice, it ignores the second)
            finally:
                self._pending_tokens[prefill.worker_id] -= len(prompt) + len(resume)

        asyncio.get_running_loop().create_task(watch())

    def _abort_everywhere(self, aid: str) -> None:
        """Abort attempt ``aid`` on every worker."""
        for w in [*self._prefill(), *self._decode()]:
            _quietly(w.handle.abort.remote, aid)


async def _unless_ended(reading: asyncio.Task, call):
    """``call``'s result, or ``WorkerDied`` should the worker's stream (``reading``) end
    first: a worker that is alive to Ray but hung never answers (the call is left to land,
    or not)."""
    call = asyncio.ensure_future(call)
    if not call.done():
        await asyncio.wait((call, reading), return_when=asyncio.FIRST_COMPLETED)
    if not call.done():
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits for it now
        raise WorkerDied("the decode worker's stream ended before it took the request")
    return call.result()


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # a dead worker has nothing left to free
        pass


def aborted_delta(rid: str, num_prompt_tokens: int, num_output_tokens: int) -> StreamDelta:
    """The last delta of a request aborted after ``num_output_tokens`` tokens."""
    return StreamDelta(
        request_id=rid,
        token_ids=[],
        text="",
        finished=True,
        finish_reason="abort",
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
    )
