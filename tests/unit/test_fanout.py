"""``Fanout``: several requests' deltas merged for one completions request of several
prompts; every run starts and is closed (its admission ticket released) however the
response ends."""

from __future__ import annotations

import asyncio

import pytest

from engine.wire.messages import StreamDelta
from router.fanout import Fanout


def _run(name: str, n: int, closed: list[str], gate: asyncio.Event | None = None):
    async def run():
        try:
            for k in range(n):
                if gate is not None:
                    await gate.wait()
                await asyncio.sleep(0)
                yield StreamDelta(name, [k], f"{name}{k}", k == n - 1)
        finally:
            closed.append(name)

    return run()


async def _drain(fan: Fanout) -> list[tuple[int, str]]:
    out = []
    while (item := await fan.next()) is not None:
        out.append((item[0], item[1].text))
    return out


def test_every_delta_comes_once_tagged_with_its_runs_place():
    async def main():
        closed: list[str] = []
        fan = Fanout([_run("a", 3, closed), _run("b", 1, closed), _run("c", 2, closed)])
        got = await _drain(fan)
        await fan.close()
        return got, closed

    got, closed = asyncio.run(main())
    for i, name, n in ((0, "a", 3), (1, "b", 1), (2, "c", 2)):
        assert [t for j, t in got if j == i] == [f"{name}{k}" for k in range(n)], got
    assert sorted(closed) == ["a", "b", "c"]


def test_closing_early_closes_every_run_even_one_not_yet_started():
    async def main():
        closed: list[str] = []
        gate = asyncio.Event()  # never set: the runs wait forever
        fan = Fanout([_run("a", 3, closed, gate), _run("b", 3, closed, gate)])
        await fan.close()  # at once: no run has taken a step yet
        return closed

    assert sorted(asyncio.run(main())) == ["a", "b"], "each run's finally (its ticket release) must run"


def test_a_run_that_raises_raises_from_next():
    async def broken():
        yield StreamDelta("x", [1], "x", False)
        raise RuntimeError("boom")

    async def main():
        fan = Fanout([broken()])
        try:
            with pytest.raises(RuntimeError, match="boom"):
                await _drain(fan)
        finally:
            await fan.close()

    asyncio.run(main())


def test_close_stops_every_run_even_when_its_caller_is_cancelled_again():
    async def main():
        closed: list[str] = []
        gate = asyncio.Event()  # never set: the runs would go on forever
        fan = Fanout([_run("a", 3, closed, gate), _run("b", 3, closed, gate)])

        async def response():
            try:
                await fan.next()
            finally:
                await fan.close()

        task = asyncio.create_task(response())
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away...
        await asyncio.sleep(0)
        task.cancel()  # ...and, as anyio does, every later await of the response is cancelled too
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)
        return list(closed)  # now: asyncio.run would close what is left on its way out

    assert sorted(asyncio.run(main())) == ["a", "b"], "every run must be stopped (its request aborted)"


def test_abort_ends_next_at_once_and_close_then_stops_every_run():
    async def main():
        closed: list[str] = []
        gate = asyncio.Event()
        fan = Fanout([_run("a", 3, closed, gate), _run("b", 3, closed, gate)])
        waiting = asyncio.create_task(fan.next())  # the runs wait on the gate: nothing comes
        await asyncio.sleep(0.01)
        fan.abort()
        ended = await asyncio.wait_for(waiting, 1)
        gate.set()  # deltas that come after the abort are not handed out
        await asyncio.sleep(0.01)
        after = await fan.next()
        await fan.close()
        return ended, after, fan.aborted, closed

    ended, after, aborted, closed = asyncio.run(main())
    assert (ended, after, aborted) == (None, None, True), "an aborted fan-out hands out nothing more"
    assert sorted(closed) == ["a", "b"], "close must stop every run of an aborted fan-out"
