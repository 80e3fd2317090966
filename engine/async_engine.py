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

An ``OutputSink`` (``sink``) may take outputs before the streams do: the step thread
hands it each step's outputs as one list, and it returns those it did not keep, which
go to their streams. The decode worker's sink (``decode_worker.outbox.Subscribers``)
routes requests to one outbox per router replica, so that the cost of handing a step
to the event loop follows the number of replicas, not the batch size.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from engine.core.step_shape import StepShape, shape_of
from engine.llm_engine import LLMEngine, RequestOutput

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


class OutputSink(Protocol):
    """Where requests' outputs go instead of their ``RequestStream``: what a worker that
    routes outputs its own way (``decode_worker.outbox.Subscribers``) gives ``AsyncEngine``.
    Called on the step thread only."""

    def deliver(self, outputs: list[RequestOutput], *, after_step: bool) -> list[RequestOutput]:
        """Keep the outputs of the requests it routes; return the others (in order).
        ``after_step``: the outputs of one engine step, handed over together (else an
        output made between steps: an abort, a request that joined with its first token)."""
        ...

    def fail_all(self, error: BaseException) -> None:
        """The engine failed: every request it routes ends with ``error``."""
        ...

    def forget(self, request_id: str) -> None:
        """The request was aborted: drop its route, if it has one."""
        ...


class AsyncEngine:
    """An engine stepping in its own thread, with per-request async output streams."""

    def __init__(self, engine: LLMEngine, idle_poll_s: float = 0.25, metrics=None) -> None:
        self.engine = engine
        self.metrics = metrics  # an ``engine.wire.metrics.EngineMetrics``, or None
        self._calls: deque[tuple[Callable, tuple, dict, asyncio.Future | None]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self.sink: OutputSink | None = None  # takes outputs before the streams do
        self._idle_poll_s = idle_poll_s
        self._periodic: list[Callable[[float], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.step_error: BaseException | None = None
        self._step_log: deque[tuple[StepShape, float, float]] | None = None  # ``record_steps``
        # A grammar compiled off the step thread wakes it, if it sleeps.
        engine.on_grammar_ready(self.wake)

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

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The callers' event loop, where outputs are read: the running one when the step
        thread has not started yet (it starts now), as for a stream or an outbox opened
        before any call."""
        self.start()
        assert self._loop is not None  # ``start`` set it
        return self._loop

    # -- streams ---------------------------------------------------------------

    def open_stream(self, request_id: str) -> RequestStream:
        """The request's stream, made first if it has none yet (before or after the add)."""
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = RequestStream(self.event_loop())
        return stream

    def deliver(self, out: RequestOutput) -> None:
        """Step thread: one output made between steps (an abort, a request that joined
        with its first token)."""
        self._hand_on([out], after_step=False)

    def deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Step thread: a step's outputs, handed to the sink together."""
        self._hand_on(outputs, after_step=True)

    def _hand_on(self, outputs: list[RequestOutput], after_step: bool) -> None:
        if self.metrics is not None:
            for out in outputs:
                if out.finished and out.times is not None:
                    self.metrics.on_finished(out.times)
        if self.sink is not None:
            outputs = self.sink.deliver(outputs, after_step=after_step)
        for out in outputs:
            rid = out.request_id
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(out)
            if out.finished:
                self._streams.pop(rid, None)

    def fail(self, request_id: str, error: BaseException) -> None:
        """Step thread: the request's stream ends with ``error``."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)

    async def generate(self, prompt, params, request_id: str, **kwargs) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its (merged) outputs until it finishes; aborts on exit.

        An id that already has a stream here is refused (ValueError) and that stream
        left alone."""
        if request_id in self._streams:  # the engine refuses an id it holds
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
        if self.sink is not None:
            self.sink.forget(request_id)

    # -- the step thread -------------------------------------------------------

    def _fail_all(self, error: Exception) -> None:
        """Every request in the engine ends with ``error``; their blocks are freed."""
        self.step_error = error
        self.engine.abort(self.engine.request_ids())
        for rid in list(self._streams):
            self.fail(rid, error)
        if self.sink is not None:
            self.sink.fail_all(error)

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
