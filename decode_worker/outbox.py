"""The decode worker's subscribers: one ``Outbox`` per router replica, shared by all of
that replica's requests, and which outbox each request's outputs go to.

``Subscribers`` is the worker's ``AsyncEngine`` output sink (``engine.async_engine.OutputSink``):
the step thread hands it a step's outputs, it adds each routed request's output to its
subscriber's outbox and wakes each touched outbox once, so the cost of handing a step to
the event loop, and the number of messages a worker sends, follow the number of
subscribers, not the batch size. With a ``report`` (the worker's load), each step that
touches outboxes also leaves the report on them, computed once on the step thread, so
the messages that carry the tokens carry the load too.

An outbox's lifecycle: ``open`` (by its reader, or by ``route`` for the first request
routed to it), filled per step, read by one consumer with ``take``, ``close`` when the reader goes
(its requests are returned so the worker can abort them). An outbox holds deltas only:
the full-text snapshot of each output is dropped as it comes in (the wire carries
``new_text``), so a stalled reader's backlog grows with the tokens it has not taken, not
with their square. Its size is counted (``backlog``), so its owner can bound it:
``cut_off`` ends a reader that lets it grow too far (``take`` returns None) and drops
what it held.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from engine.async_engine import AsyncEngine
from engine.output_processor import RequestOutput


class Outbox:
    """One subscriber's pending outputs: filled by the step thread, taken by one reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[str, list[RequestOutput | BaseException]] = {}
        self._ready = asyncio.Event()
        self._signalled = False
        self.reader = 0  # the current reader's token; a new reader supersedes the old one
        self.report: Any = None  # the step thread's latest ``Subscribers.report`` with these outputs
        self._count = 0  # outputs pending
        self._over_since: float | None = None  # since when ``_count`` has been past the bound
        self.taken = 0  # how many outputs the last ``take`` returned
        self.cut = False  # cut off: ``take`` returns None from now on

    def claim(self) -> int:
        """Become the outbox's only reader; an earlier reader's ``take`` returns None."""
        self.reader += 1
        self._ready.set()  # wake the old reader so it can leave
        return self.reader

    def add(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Step thread: queue an output (or an error) without waking the reader yet."""
        if isinstance(item, RequestOutput):
            item.text = ""  # the full text so far: one snapshot per pending output would grow quadratically
        with self._lock:
            if self.cut:
                return
            self._count += 1
            items = self._pending.get(request_id)
            if items is None:
                self._pending[request_id] = [item]
            else:
                items.append(item)

    def signal(self) -> None:
        """Step thread: wake the reader, once however many outputs were added."""
        with self._lock:
            if self._signalled:
                return
            self._signalled = True
        self._loop.call_soon_threadsafe(self._ready.set)

    async def take(self, reader: int) -> dict[str, list[RequestOutput | BaseException]] | None:
        """Everything added since the previous call, by request (waits for something);
        None once another reader has claimed the outbox."""
        while True:
            await self._ready.wait()
            if reader != self.reader or self.cut:
                return None  # the event stays set: the new reader may have work waiting
            self._ready.clear()
            with self._lock:
                pending, self._pending = self._pending, {}
                self.taken, self._count, self._over_since = self._count, 0, None
                self._signalled = False
            if pending:
                return pending

    def backlog(self, now: float, limit: int, patience_s: float) -> bool:
        """Step thread: whether the outputs pending have stayed past ``limit`` for
        ``patience_s`` (or passed twice it): the reader is too slow to keep."""
        with self._lock:
            if self._count <= limit:
                self._over_since = None
                return False
            if self._over_since is None:
                self._over_since = now
            return self._count > 2 * limit or now - self._over_since >= patience_s

    def cut_off(self) -> None:
        """Step thread: drop what is pending and end the reader (``take`` returns None)."""
        with self._lock:
            self.cut = True
            self._pending, self._count = {}, 0
        self._loop.call_soon_threadsafe(self._ready.set)


class Subscribers:
    """Every subscriber's outbox and each routed request's subscriber: the decode worker's
    output sink on its ``AsyncEngine`` (set it as ``runtime.sink``). Step thread only,
    but for ``open`` from the event loop before the step thread starts."""

    def __init__(self, runtime: AsyncEngine, report: Callable[[], Any] | None = None) -> None:
        """``runtime``: whose callers' event loop the outboxes wake; ``report``: run once
        after each step that feeds outboxes, its result left on each (``Outbox.report``)."""
        self._runtime = runtime
        self.report = report
        self._outboxes: dict[str, Outbox] = {}  # subscriber -> its outbox
        self._routes: dict[str, Outbox] = {}  # request id -> the outbox its outputs go to

    def open(self, subscriber: str) -> Outbox:
        """The subscriber's outbox, made first if it has none yet."""
        outbox = self._outboxes.get(subscriber)
        if outbox is None:
            outbox = self._outboxes[subscriber] = Outbox(self._runtime.event_loop())
        return outbox

    def outboxes(self) -> list[tuple[str, Outbox]]:
        """Every subscriber's outbox."""
        return list(self._outboxes.items())

    def route(self, request_id: str, subscriber: str) -> None:
        """Send the request's outputs to ``subscriber``'s outbox (before it can produce any)."""
        self._routes[request_id] = self.open(subscriber)

    def close(self, subscriber: str, reader: int) -> list[str]:
        """The subscriber's reader went away: forget its outbox (unless a newer reader
        holds it); returns its unfinished requests."""
        outbox = self._outboxes.get(subscriber)
        if outbox is None or outbox.reader != reader:
            return []
        del self._outboxes[subscriber]
        orphans = [rid for rid, ob in self._routes.items() if ob is outbox]
        for rid in orphans:
            del self._routes[rid]
        return orphans

    # -- the output sink (``engine.async_engine.OutputSink``) ------------------

    def deliver(self, outputs: list[RequestOutput], *, after_step: bool) -> list[RequestOutput]:
        """Add each routed request's output to its outbox and wake each touched outbox
        once (after a step, with the report left on it first); returns the others."""
        others: list[RequestOutput] = []
        touched: dict[int, Outbox] = {}
        routes = self._routes
        for out in outputs:
            rid = out.request_id
            outbox = routes.get(rid)
            if outbox is None:
                others.append(out)
                continue
            outbox.add(rid, out)
            if out.finished:
                del routes[rid]
            touched[id(outbox)] = outbox
        if touched and after_step and self.report is not None:
            report = self.report()
            for outbox in touched.values():
                outbox.report = report
        for outbox in touched.values():
            outbox.signal()
        return others

    def fail_all(self, error: BaseException) -> None:
        """The engine failed: every routed request ends with ``error``."""
        for rid, outbox in self._routes.items():
            outbox.add(rid, error)
            outbox.signal()
        self._routes.clear()

    def forget(self, request_id: str) -> None:
        """The request was aborted: nothing more of it goes anywhere."""
        self._routes.pop(request_id, None)
