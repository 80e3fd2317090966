"""Several choices of one response run side by side (``Fanout``): a request with ``n`` > 1
or a list of prompts is a run a choice, each prompt's first choice prefilling it alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from engine.wire.messages import StreamDelta
from router.admission import Ticket
from router.dispatch import Affinity
from router.openai_api import Accumulator
from router.stream_events import echoed
from router.validation import Choice

if TYPE_CHECKING:
    from router.core import RouterCore


class Fanout:
    """The deltas of several runs as they come, each with its run's place.

    The runs start at once, each in a task of its own, so every one releases its
    admission ticket however it ends; ``close`` stops those still going (which aborts
    their requests). A run that raises raises from ``next``. ``firsts`` (one event a
    run, optional): set when the run's first delta came, or when it ended without one.
    ``abort`` ends the fan-out at once: ``next`` returns None from then on.
    """

    def __init__(self, runs: list[AsyncIterator], firsts: list[asyncio.Event] | None = None) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._left = len(runs)
        firsts = firsts or [asyncio.Event() for _ in runs]
        self._closing: asyncio.Future | None = None
        self.aborted = False
        self._tasks = [asyncio.ensure_future(self._pump(i, run, firsts[i])) for i, run in enumerate(runs)]

    async def _pump(self, i: int, run, first: asyncio.Event) -> None:
        try:
            async with aclosing(run):
                async for delta in run:
                    first.set()
                    self._queue.put_nowait((i, delta))
        except Exception as e:  # a worker's failure comes as a delta; this is a bug, not a disconnect
            self._queue.put_nowait((i, e))
        else:
            self._queue.put_nowait((i, None))  # the run is over
        finally:
            first.set()  # a run waiting on this one goes on without the cache

    async def next(self) -> tuple[int, StreamDelta] | None:
        """The next (place, delta); None once every run is over, or once aborted."""
        while self._left and not self.aborted:
            i, delta = await self._queue.get()
            if isinstance(delta, Exception):
                raise delta
            if delta is not None:
                return i, delta
            self._left -= 1  # run i is over (or, aborted, all are)
        return None

    def abort(self) -> None:
        """End the fan-out: ``next`` returns None, however many runs are still going
        (``close`` stops them)."""
        self.aborted = True
        self._queue.put_nowait((None, None))  # wakes a ``next`` that waits

    async def close(self) -> None:
        """Stop the runs still going and wait for them. Shielded: a client gone cancels
        the response, and under Starlette (anyio) every later await of it is cancelled
        too, so the stopping goes on in a task of its own."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._closing)

    async def _stop(self) -> None:
        await asyncio.sleep(0)  # a task cancelled before its first step would never start its run
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def fan_out(core: RouterCore, batch: list[Choice], tickets: list[Ticket], rid: str) -> Fanout:
    """The choices of one response run side by side: each prompt's first choice at once,
    the others once it streams (its prompt's blocks are then cached), placed with it."""
    firsts = [asyncio.Event() for _ in batch]
    affinities = {c.leader: Affinity() for c in batch}
    runs = [
        core.run(c.prepared, f"{rid}-{j}", ticket, None if c.leader == j else firsts[c.leader], affinities[c.leader])
        for j, (c, ticket) in enumerate(zip(batch, tickets))
    ]
    return Fanout(runs, firsts)


async def many_deltas(fan: Fanout, accs: list[Accumulator], batch: list[Choice]):
    """(place, delta, its logprobs) as they come, each folded into its accumulator (after
    the echo of its prompt, on its first delta)."""
    started = [False] * len(batch)
    while (item := await fan.next()) is not None:
        i, delta = item
        if not started[i]:
            started[i], delta = True, echoed(delta, batch[i].prepared)
        yield i, delta, None if delta.error else accs[i].add(delta)
