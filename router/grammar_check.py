"""Checks structured-output specs with xgrammar, outside the router process, within bounds.

A check has two parts. First the spec's bounds (``engine.grammar.precheck`` with the
router's ``GrammarLimits``: regex sizes, schema depth, size keywords), on a thread, in
milliseconds: a spec past them is refused before anything parses it. Then the parse:
xgrammar imports torch, which the router process never loads, so it runs in a helper
process (one, spawned on the first constrained request; it imports xgrammar before it
reports ready, and the first constrained request waits for that). Verdicts of the parse
are cached here by (kind, spec): a spec is sent at most once while it stays in the cache.

The helper parses one spec at a time (the others wait their turn) and gets
``compile_timeout_s`` of wall-clock time for it. A parse past the limit is refused, and
cached so, with a message naming the limit, and the helper is killed (its parse cannot be
stopped any other way); a request that goes away while its spec is being parsed kills it
too. A new helper is spawned for the next check. A helper that died is replaced on the
next check (a spec the helper dies on twice is refused); a helper whose router died exits.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection

from engine.grammar import MAX_CACHED_GRAMMARS, GrammarLimits, message, precheck, problem, too_slow
from engine.wire.sampling_params import StructuredOutput

Judge = Callable[[str, str], "str | None"]  # (kind, spec) -> why it does not parse, or None
START_TIMEOUT_S = 120.0  # a helper's spawn and its import of xgrammar (torch, transformers): seconds


def _exit_with_parent(parent: int) -> None:
    """In the helper: leave when the router process is gone (Ray may kill it outright)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _serve(conn: Connection, parent: int, judge: Judge) -> None:
    """The helper's loop: a (kind, spec) in, ``judge``'s verdict out, until the pipe closes.
    The first verdict (of the JSON object format) imports the parser before it says ready."""
    _exit_with_parent(parent)
    judge("json_object", "")
    conn.send("ready")
    while True:
        try:
            kind, spec = conn.recv()
        except EOFError:
            return
        conn.send(judge(kind, spec))


async def _readable(conn: Connection, timeout_s: float) -> None:
    """Return once ``conn`` has something to read (or its other end closed); TimeoutError
    after ``timeout_s``. Waits on the event loop, with no thread."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout_s)
    finally:
        loop.remove_reader(fd)


class _Helper:
    """One helper process and the router's end of its pipe."""

    def __init__(self, judge: Judge) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, os.getpid(), judge), daemon=True)
        self.process.start()
        child.close()

    async def ready(self) -> None:
        await _readable(self.conn, START_TIMEOUT_S)
        self.conn.recv()  # "ready"; EOFError if it died starting

    async def ask(self, so: StructuredOutput, timeout_s: float) -> str | None:
        """The helper's verdict on ``so``; TimeoutError past ``timeout_s``, EOFError if it died."""
        self.conn.send((so.kind, so.spec))
        await _readable(self.conn, timeout_s)
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class GrammarChecker:
    """Checks structured-output specs against ``limits`` and parses them in a helper process
    spawned on the first check, caching the verdicts. ``RouterCore`` keeps one for its life;
    ``close`` stops the helper. ``judge``: the parse the helper runs (``problem``; tests
    give others)."""

    def __init__(
        self, limits: GrammarLimits | None = None, max_cached: int = MAX_CACHED_GRAMMARS, judge: Judge = problem,
    ) -> None:
        self.limits = limits or GrammarLimits()
        self._judge = judge
        self._helper: _Helper | None = None
        self._turn = asyncio.Lock()  # the helper parses one spec at a time
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self._max_cached = max_cached

    async def check(self, so: StructuredOutput, field: str | None) -> str | None:
        """None when the spec is within bounds and xgrammar parses it in time, else the
        error message (naming ``field`` and, for a bound or the time, the limit)."""
        key = (so.kind, so.spec)
        if key not in self._verdicts:
            try:
                await asyncio.to_thread(precheck, so, field, self.limits)
            except ValueError as e:
                return str(e)
            async with self._turn:
                if key not in self._verdicts:  # else: parsed while this one waited its turn
                    self._verdicts[key] = await self._ask(so)
                    while len(self._verdicts) > self._max_cached:
                        self._verdicts.popitem(last=False)
        self._verdicts.move_to_end(key)
        why = self._verdicts[key]
        return None if why is None else message(so, field, why)

    async def _ask(self, so: StructuredOutput) -> str | None:
        """The helper's verdict on ``so``, within the time limit (a new helper if it died)."""
        for attempt in range(2):
            helper = await self._started_helper()
            try:
                return await helper.ask(so, self.limits.compile_timeout_s)
            except TimeoutError:
                self._stop_helper()
                return too_slow("parsing", self.limits)
            except (EOFError, OSError):
                self._stop_helper()  # it died: a new one on the next try
                if attempt:
                    return "the parser died on it"
            except asyncio.CancelledError:  # the request went away: its parse ends with the helper
                self._stop_helper()
                raise
        return None

    async def _started_helper(self) -> _Helper:
        """The helper, spawned and ready (RuntimeError if it cannot start: the server's fault)."""
        if self._helper is None:
            self._helper = _Helper(self._judge)
            try:
                await self._helper.ready()
            except BaseException as e:  # cancelled too: a helper half started is no use
                self._stop_helper()
                if isinstance(e, (TimeoutError, EOFError, OSError)):
                    raise RuntimeError(f"the grammar-check helper did not start: {e!r}") from e
                raise
        return self._helper

    def _stop_helper(self) -> None:
        if self._helper is not None:
            self._helper.kill()
            self._helper = None

    def close(self) -> None:
        self._stop_helper()
