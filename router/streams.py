"""The decode workers' token streams, handed out to the requests: ``Subscriptions``, ``Inbox``.

A dispatcher hears from each decode worker over one stream (the worker's token channel, a
TCP connection, or where that cannot be reached its Ray ``subscribe``). Each message holds
one engine step's deltas for all of this dispatcher's requests on that worker and the
worker's load after the step; ``Subscriptions`` hands each delta to its request's ``Inbox``
and the load to the dispatcher. So the messages per step do not grow with the batch, and
an abort is just one more item in the request's inbox.

A subscription (one attempt of a request, on one worker's stream)::

    open ─▶ deltas into its inbox ─▶ close (the attempt is over: finished, failed, moved)
             ╰─▶ the stream ended: WorkerDied or CutOff into its inbox, the route dropped

A stream is started by the first ``open`` for its worker and kept while the worker lives.
It ends when the worker dies, when it hangs (it does not answer within the channel's
deadline), or when it cuts this dispatcher off; the next ``open`` starts a new one under a
new subscriber name, so a new stream never shares a worker-side outbox with an old one.

The token channel reconnects on its own after a network blip (the worker keeps the stream
for ``channel.reconnect_grace_s``, and no delta is lost or doubled), so only a channel that
cannot be resumed counts as the worker's death (``WorkerDied``). A worker that finds this
dispatcher too slow to read its stream tells it (logged, counted), then cuts it off
(``CutOff``): placing those requests again would not make the reader faster.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from engine.wire import token_channel
from engine.wire.channel_wire import Notice, NoticeKind
from engine.wire.clients import DecodeClient
from engine.wire.messages import DecodeLoad, StepMessage, StreamDelta, WorkerRef
from engine.wire.token_channel import ChannelConfig

log = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerDied(RuntimeError):
    """The decode worker's subscription stream broke: the worker is gone."""


class CutOff(RuntimeError):
    """The decode worker dropped this dispatcher's stream for falling behind; its
    requests there were aborted."""


class Abort(enum.Enum):
    """What ``Dispatcher.abort`` puts in a request's inbox: the request's own task aborts it
    everywhere."""

    REQUESTED = enum.auto()


# What a request's inbox holds: its deltas, the end of its worker's stream, or an abort.
InboxItem = StreamDelta | WorkerDied | CutOff | Abort


class Inbox:
    """One request's deltas as the subscription delivers them (a minimal async queue).

    Workers know the request by its attempt's id; its deltas go out under
    ``request_id``, the client's."""

    __slots__ = ("_items", "_waiter", "request_id")

    def __init__(self, request_id: str = "") -> None:
        self._items: deque[InboxItem] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.request_id = request_id

    def put(self, item: InboxItem) -> None:
        """Deliver ``item`` to the request's task."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def drop_ended_streams(self) -> None:
        """Forget the ends of streams (``WorkerDied``, ``CutOff``) that came while the
        request was being placed on a worker it then left, so they do not end the next attempt."""
        self._items = deque(i for i in self._items if not isinstance(i, (WorkerDied, CutOff)))

    async def get(self) -> InboxItem:
        """The next item, once there is one."""
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
        self, name: str, on_load: Callable[[str, DecodeLoad], None] = lambda worker_id, load: None,
        channel: ChannelConfig | None = None, on_event: Callable[[str], None] = lambda event: None,
    ) -> None:
        self.name = name
        self._on_load = on_load  # (worker id, DecodeLoad) from each step message
        self.channel = channel or ChannelConfig()
        self._on_event = on_event  # a ``NoticeKind`` value, for each ``Notice`` a stream brings
        self._streams = itertools.count()
        self._inboxes: dict[str, dict[str, Inbox]] = {}  # worker key -> request id -> inbox
        self._readers: dict[str, tuple[asyncio.Task[None], str]] = {}  # worker key -> (reader, subscriber)

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

    def reader(self, worker: WorkerRef) -> asyncio.Task[None]:
        """The task reading ``worker``'s stream (``open`` started it): done when the stream ended."""
        return self._readers[worker.key][0]

    def close(self, worker: WorkerRef, request_id: str) -> None:
        """The request's attempt on ``worker`` is over: its deltas go nowhere any more."""
        inboxes = self._inboxes.get(worker.key)
        if inboxes is not None:
            inboxes.pop(request_id, None)

    async def _read(self, worker: WorkerRef, subscriber: str) -> None:
        inboxes = self._inboxes[worker.key]
        make = StreamDelta._make
        error: WorkerDied | CutOff = WorkerDied(f"decode worker {worker.worker_id} ended its stream")
        try:
            async with aclosing(self._messages(worker, subscriber)) as messages:
                async for message in messages:
                    if isinstance(message, Notice):
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

    async def _messages(self, worker: WorkerRef, subscriber: str) -> AsyncGenerator[StepMessage | Notice, None]:
        """The worker's step messages for ``subscriber``: over its token channel when it
        has one this process can reach, else over Ray (``subscribe``)."""
        client = DecodeClient(worker.handle)
        # A worker that does not answer within the channel's deadline is hung: its stream ends.
        address = await asyncio.wait_for(client.token_channel(), self.channel.heartbeat_timeout_s)
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
        async for ref in client.subscribe(subscriber):
            yield await ref

    def stop(self) -> None:
        """Stop reading every stream."""
        for task, _ in self._readers.values():
            task.cancel()


async def unless_ended(reading: asyncio.Task[None], call: Awaitable[T]) -> T:
    """``call``'s result, or ``WorkerDied`` should the worker's stream (``reading``) end
    first: a worker that is alive to Ray but hung never answers (the call is left to land,
    or not)."""
    answer = asyncio.ensure_future(call)
    if not answer.done():
        either: tuple[asyncio.Future[T] | asyncio.Future[None], ...] = (answer, reading)
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if not answer.done():
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits for it now
        raise WorkerDied("the decode worker's stream ended before it took the request")
    return answer.result()
