"""Drives an ``LLMEngine`` from a background thread for asyncio callers (the workers).

The engine is not thread-safe, and only the step thread touches it. Asyncio callers
hand it work with ``await call(fn, ...)`` (or ``submit`` when they cannot wait): the
step thread runs queued calls between steps, so a caller waits at most one step and
the event loop never blocks on the engine. (A lock the event loop took itself would
stall the loop for whole steps, and the step thread, re-taking it at once, would
starve it, holding back every token the worker streams.) The step thread runs
``engine.step()`` while there is schedulable work and sleeps otherwise. Metrics are
exported after each step, and the load gauges (KV usage, running, waiting) also after
each run of queued calls and before sleeping, so that at idle they agree with the pool;
a caller of ``call`` sees them updated for what its call did. Each
request's outputs go to its ``RequestStream``; a consumer that falls behind gets the
pending outputs merged into one delta, so a slow reader costs one message per read,
not one per token.

A stream's lifecycle: ``open_stream`` (before or after the request is added), outputs
arrive from the step thread, the stream ends with a finished output or ``close``.

Requests can instead be routed to an ``Outbox`` (``route``): one per subscriber (a
router replica), shared by all of that subscriber's requests. The step thread adds a
step's outputs to the outboxes and wakes each touched outbox once, so the cost of
handing a step to the event loop, and the number of messages a worker sends, follow
the number of subscribers, not the batch size. An outbox's lifecycle: ``open_outbox``
(by its reader or by the first request routed to it), filled per step, read by one
consumer with ``take``, ``close_outbox`` when the reader goes (its requests are
returned so the caller can abort them). An outbox holds deltas only: the full-text
snapshot of each output is dropped as it comes in (the wire carries ``new_text``), so a
stalled reader's backlog grows with the tokens it has not taken, not with their square.
Its size is counted (``backlog``), so its owner can bound it: ``cut_off`` ends a reader
that lets it grow too far (``take`` returns None) and drops what it held. With a
``step_report`` (the worker's load),
each step that touches outboxes also leaves the report on them, computed once on the
step thread, so the messages that carry the tokens carry the load too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.core.step_shape import StepShape, shape_of
from engine.llm_engine import LLMEngine, RequestOutput

_T = TypeVar("_T")

log = logging.getLogger(__name__)


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Fold consecutive outputs of one request into one delta (the last one's totals)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    last.new_token_ids = [t for o in outs for t in o.new_token_ids]
    last.new_text = "".join(o.new_text for o in outs)
    if last.new_logprobs is not None:
        last.new_logprobs = [lp for o in outs for lp in o.new_logprobs or ()]
    if outs[0].prompt_logprobs is not None:  # only ever on a request's first output
        last.prompt_logprobs = outs[0].prompt_logprobs
    return last


class RequestStream:
    """One request's outputs (or its error): put by the step thread, read on the event loop,
    merged into one delta per read. ``open_stream`` makes it; it is dropped once the
    request finishes or is aborted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: called from the step thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> RequestOutput:
        """Everything produced since the last call, merged; raises a delivered error."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        errors = [i for i in items if isinstance(i, BaseException)]
        if errors:
            self.finished = True
            raise errors[0]
        out = merge_outputs(items)  # type: ignore[arg-type]
        self.finished = out.finished
        return out


class Outbox:
    """One subscriber's pending outputs: filled by the step thread, taken by one reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[str, list[RequestOutput | BaseException]] = {}
        self._ready = asyncio.Event()
        self._signalled = False
        self.reader = 0  # the current reader's token; a new reader supersedes the old one
        self.report = None  # the step thread's latest ``step_report`` with these outputs
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


class AsyncEngine:
    """An engine stepping in its own thread, with per-request async output streams."""

    def __init__(self, engine: LLMEngine, idle_poll_s: float = 0.25, metrics=None) -> None:
        self.engine = engine
        self.metrics = metrics  # an ``engine.wire.metrics.EngineMetrics``, or None
        self._calls: deque[tuple[Callable, tuple, dict, asyncio.Future | None]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._outboxes: dict[str, Outbox] = {}  # subscriber -> its outbox
        self._routes: dict[str, Outbox] = {}  # request id -> the outbox its outputs go to
        self._idle_poll_s = idle_poll_s
        self._periodic: list[Callable[[float], None]] = []
        self.step_report: Callable[[], Any] | None = None  # run after each step that feeds outboxes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.step_error: BaseException | None = None
        self._step_log: deque[tuple[StepShape, float, float]] | None = None  # ``record_steps``
        # A grammar compiled off the step thread wakes it, if it sleeps.
        engine.structured.on_ready = self.wake

    def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()

    async def stop(self) -> None:
        """Shut the step thread down and wait until it has stopped (the engine is then
        free for another caller; calls still queued are dropped)."""
        self.shutdown()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def add_periodic(self, fn: Callable[[float], None]) -> None:
        """Run ``fn(now)`` on the step thread on every loop turn (deadlines, leases);
        ``now`` is ``time.monotonic()``."""
        self._periodic.append(fn)

    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn(*args, **kwargs)`` on the step thread between steps; its result."""
        self.start()
        future = self._loop.create_future()
        self._calls.append((fn, args, kwargs, future))
        self._wake.set()
        return await future

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> None:
        """Queue ``fn`` for the step thread without waiting (from ``finally`` blocks)."""
        self._calls.append((fn, args, kwargs, None))
        self._wake.set()

    def record_steps(self, limit: int) -> None:
        """Keep the shape (``engine.core.step_shape``), start and wall time of each of the latest
        ``limit`` steps (0: stop keeping them). A step's time is its turn of the step
        thread: the queued calls run before it, the step, and handing its outputs on (what
        spaces one token of a busy worker's streams from the next). Its start is on
        ``time.monotonic()``, one clock for every process of a host."""
        self._step_log = deque(maxlen=limit) if limit > 0 else None

    def take_steps(self) -> list[tuple[StepShape, float, float]]:
        """The steps kept since the last call (``record_steps``), oldest first: (shape,
        start, seconds)."""
        log, taken = self._step_log, []
        while log:
            taken.append(log.popleft())
        return taken

    def _run_calls(self) -> None:
        if not self._calls:
            return
        done = []
        while self._calls:
            fn, args, kwargs, future = self._calls.popleft()
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as e:  # handed to the caller, never raised here
                result, error = None, e
            if future is not None:
                done.append((future, result, error))
        # Calls free and reserve blocks between steps (a transfer's end, an abort, a
        # reservation), and no step may follow to export that: the gauges catch up now,
        # before any caller hears back, so what a call's caller reads next agrees.
        self._export_load()
        for future, result, error in done:
            self._loop.call_soon_threadsafe(_settle, future, result, error)

    def _export_load(self) -> None:
        if self.metrics is not None:
            self.metrics.on_load(self.engine.load())  # writes only what changed

    def wake(self) -> None:
        self._wake.set()

    # -- streams ---------------------------------------------------------------

    def open_stream(self, request_id: str) -> RequestStream:
        return self._open(self._streams, request_id, RequestStream)

    def open_outbox(self, subscriber: str) -> Outbox:
        return self._open(self._outboxes, subscriber, Outbox)

    def _open(
        self, table: dict[str, _T], key: str, make: Callable[[asyncio.AbstractEventLoop], _T]
    ) -> _T:
        """``table[key]``, made on this loop first if it is not there yet."""
        self.start()
        item = table.get(key)
        if item is None:
            item = table[key] = make(self._loop)
        return item

    def outboxes(self) -> list[tuple[str, Outbox]]:
        """Step thread: every subscriber's outbox."""
        return list(self._outboxes.items())

    def route(self, request_id: str, subscriber: str) -> None:
        """Send the request's outputs to ``subscriber``'s outbox (before it can produce any)."""
        self._routes[request_id] = self.open_outbox(subscriber)

    def unroute(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    def close_outbox(self, subscriber: str, reader: int) -> list[str]:
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

    def deliver(self, out: RequestOutput) -> None:
        outbox = self._put(out)
        if outbox is not None:
            outbox.signal()

    def deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs: each touched outbox is woken once."""
        touched = {}
        for out in outputs:
            outbox = self._put(out)
            if outbox is not None:
                touched[id(outbox)] = outbox
        if touched and self.step_report is not None:
            report = self.step_report()
            for outbox in touched.values():
                outbox.report = report
        for outbox in touched.values():
            outbox.signal()

    def _put(self, out: RequestOutput) -> Outbox | None:
        if out.finished and out.times is not None and self.metrics is not None:
            self.metrics.on_finished(out.times)
        rid = out.request_id
        outbox = self._routes.get(rid)
        if outbox is not None:
            outbox.add(rid, out)
            if out.finished:
                del self._routes[rid]
            return outbox
        stream = self._streams.get(rid)
        if stream is not None:
            stream.put(out)
        if out.finished:
            self._streams.pop(rid, None)
        return None

    def fail(self, request_id: str, error: BaseException) -> None:
        outbox = self._routes.pop(request_id, None)
        if outbox is not None:
            outbox.add(request_id, error)
            outbox.signal()
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)

    async def generate(self, prompt, params, request_id: str, **kwargs) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its (merged) outputs until it finishes; aborts on exit.

        An id that already has a stream here is refused (ValueError) and that stream
        left alone."""
        if request_id in self._streams or request_id in self._routes:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self.open_stream(request_id)
        try:
            await self.call(self.engine.add_request, prompt, params, request_id=request_id, **kwargs)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add still runs on the step thread: undo it
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self.follow(request_id, stream):
            yield out

    async def follow(self, request_id: str, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield a stream's outputs until it finishes; abort the request if we stop early."""
        try:
            while not stream.finished:
                yield await stream.get()
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort the request (on the step thread, soon); a reader of its stream gets "abort"."""
        self.submit(self.abort_now, request_id)

    def abort_now(self, request_id: str) -> None:
        """``abort`` for code already on the step thread (periodic functions, calls)."""
        for out in self.engine.abort(request_id):
            self.deliver(out)
        self._streams.pop(request_id, None)
        self._routes.pop(request_id, None)

    # -- the step thread -------------------------------------------------------

    def _fail_all(self, error: Exception) -> None:
        """Every request in the engine ends with ``error``; their blocks are freed."""
        self.step_error = error
        self.engine.abort(self.engine.request_ids())
        for rid in [*self._streams, *self._routes]:
            self.fail(rid, error)

    def _run(self) -> None:
        while not self._stop.is_set():
            turn_start = time.monotonic()
            self._run_calls()
            now = time.monotonic()
            for fn in self._periodic:
                try:
                    fn(now)
                except Exception:  # a bug in one check must not stop the engine: it runs again next turn
                    log.exception("periodic %s failed on the step thread", getattr(fn, "__qualname__", fn))
            busy = self.engine.has_schedulable_work()
            if busy:
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a broken step must not hang the streams
                    self._fail_all(e)
                    continue
                self.deliver_all(outputs)
                if self.metrics is not None:
                    self.metrics.on_step(self.engine.stats())
                if self._step_log is not None:
                    self._step_log.append((shape_of(self.engine.last_plan), turn_start, time.monotonic() - turn_start))
            elif not self._calls:
                self._export_load()  # what periodic functions (leases, deadlines) freed
                self._wake.wait(self._idle_poll_s)
                self._wake.clear()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the caller went away; the call itself has run
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
