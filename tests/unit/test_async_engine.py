"""AsyncEngine: the step thread behind the workers' streams."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.outbox import Subscribers
from engine import LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core.request import RequestStatus
from tests.helpers import PATIENCE_S, async_wait_for


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(model=str(default_model), num_kv_blocks=128)


def _params(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_streams_deliver_every_token_once_and_free_blocks(engine):
    runtime = AsyncEngine(engine)

    async def one(rid, prompt, n):
        tokens, text, last = [], "", None
        async for out in runtime.generate(prompt, _params(n), rid):
            tokens += out.new_token_ids
            text += out.new_text
            last = out
        return tokens, text, last

    async def main():
        return await asyncio.gather(*(one(f"s{i}", [5 + i] * (10 + i), 8 + i) for i in range(6)))

    results = asyncio.run(main())
    runtime.shutdown()
    for i, (tokens, text, last) in enumerate(results):
        assert last.finished and tokens == last.token_ids, f"stream {i} lost or repeated tokens"
        assert len(tokens) == 8 + i and text == last.text
    assert engine.stats().num_blocks_in_use == 0


def test_leaving_a_stream_early_aborts_the_request(engine):
    runtime = AsyncEngine(engine)

    async def main():
        # Far more tokens than the abort takes to arrive: a request that ended by length
        # would have run on after its reader left.
        async for _ in runtime.generate([7] * 20, _params(1000), "early"):
            request = await runtime.call(engine.scheduler.requests.get, "early")
            break  # the consumer goes away after the first delta
        await async_wait_for(lambda: runtime.call(lambda: request.is_finished), PATIENCE_S,
                             "the abandoned request to end")
        return request, await runtime.call(lambda: "early" in engine.scheduler.requests)

    request, still_there = asyncio.run(main())
    runtime.shutdown()
    assert request.status == RequestStatus.FINISHED_ABORTED, (
        f"an abandoned stream must abort its request; it ended {request.status.name}"
    )
    assert not still_there, "an aborted request must leave the scheduler"
    assert engine.stats().num_blocks_in_use == 0


def test_a_failing_step_ends_every_stream_with_the_error(engine, monkeypatch):
    runtime = AsyncEngine(engine)

    def broken_step():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine, "step", broken_step)

    async def main():
        async for _ in runtime.generate([9] * 12, _params(5), "doomed"):
            pass

    with pytest.raises(RuntimeError, match="injected step failure"):
        asyncio.run(asyncio.wait_for(main(), PATIENCE_S))  # a guard against a hang, not a bound
    runtime.shutdown()
    monkeypatch.undo()
    assert not engine.scheduler.requests and engine.stats().num_blocks_in_use == 0


def test_engine_calls_from_the_event_loop_do_not_hold_back_streamed_tokens(engine):
    """A worker's load is polled often; that must not stall its event loop, or the
    tokens of many steps reach the client together."""
    runtime = AsyncEngine(engine)
    n = 48

    async def main():
        polling = True

        async def poll():  # like the router's load poll, only far more often
            while polling:
                await runtime.call(engine.stats)
                await asyncio.sleep(0.002)

        poller = asyncio.create_task(poll())
        async def one(i):
            return [len(out.new_token_ids) async for out in runtime.generate([11 + i] * 400, _params(n), f"p{i}")]

        per = await asyncio.gather(*(one(i) for i in range(6)))
        sizes = [s for p in per for s in p]
        polling = False
        await poller
        return sizes

    sizes = asyncio.run(main())
    runtime.shutdown()
    assert sum(sizes) == 6 * n
    assert sum(s == 1 for s in sizes) >= 3 * n, f"tokens arrived in clumps: {sizes}"
    assert engine.stats().num_blocks_in_use == 0


def test_a_step_report_is_made_once_per_step_and_left_on_every_outbox_the_step_fed(engine, monkeypatch):
    runtime = AsyncEngine(engine)
    steps, reports = [], []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    subscribers = Subscribers(runtime, report=lambda: reports.append(engine.load().num_running) or len(reports))
    runtime.sink = subscribers

    async def drain(box, reader) -> list[int]:
        """The report seen with each take, until the box's request finished."""
        seen = []
        while True:
            pending = await box.take(reader)
            seen.append(box.report)
            if any(out.finished for outs in pending.values() for out in outs):
                return seen

    async def main():
        boxes = [subscribers.open(name) for name in ("a", "b")]
        readers = [box.claim() for box in boxes]
        for rid, name in (("x", "a"), ("y", "b")):
            subscribers.route(rid, name)
        await runtime.call(lambda: [engine.add_request([5, 6, 7], _params(4), rid) for rid in ("x", "y")])
        return await asyncio.wait_for(
            asyncio.gather(*(drain(box, r) for box, r in zip(boxes, readers))), PATIENCE_S
        )

    seen_a, seen_b = asyncio.run(main())
    runtime.shutdown()
    assert len(reports) == len(steps), "one report per step, however many outboxes it fed"
    assert reports[0] == 2, "the report is made after the step, on the engine's state then"
    assert seen_a[-1] == seen_b[-1] == len(reports), "each outbox holds the latest report"
    assert engine.stats().num_blocks_in_use == 0


def test_a_failing_step_ends_every_routed_request_with_the_error_in_its_outbox(engine, monkeypatch):
    """The sink hears a broken step too: a subscriber's requests end with the error, not a hang."""
    runtime = AsyncEngine(engine)
    subscribers = Subscribers(runtime)
    runtime.sink = subscribers

    def broken_step():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine, "step", broken_step)

    async def main():
        box = subscribers.open("a")
        reader = box.claim()
        for rid in ("fx", "fy"):
            subscribers.route(rid, "a")
        await runtime.call(lambda: [engine.add_request([5, 6, 7], _params(4), rid) for rid in ("fx", "fy")])
        got = {}
        while len(got) < 2:
            got.update(await asyncio.wait_for(box.take(reader), PATIENCE_S))
        return got, await runtime.call(subscribers.close, "a", reader)

    got, orphans = asyncio.run(main())
    runtime.shutdown()
    monkeypatch.undo()
    assert sorted(got) == ["fx", "fy"] and all(
        len(items) == 1 and isinstance(items[0], RuntimeError) for items in got.values()
    ), got
    assert orphans == [], "a failed request is no longer routed"
    assert not engine.scheduler.requests and engine.stats().num_blocks_in_use == 0


def test_a_periodic_function_that_fails_once_does_not_stop_the_step_thread(engine):
    """A deadline or lease check that raises (a worker's bug) is logged; the step thread
    goes on stepping, and every stream still ends (it once died silently, leaving its
    worker alive to Ray with no engine behind it)."""
    runtime = AsyncEngine(engine)
    calls = []

    def flaky(now: float) -> None:
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")

    runtime.add_periodic(flaky)

    async def main():
        async def read():
            return [out async for out in runtime.generate([9] * 12, _params(6), "after")]

        return await asyncio.wait_for(read(), PATIENCE_S)

    outs = asyncio.run(main())
    runtime.shutdown()
    assert outs[-1].finished and len(outs[-1].token_ids) == 6
    assert len(calls) > 1, "the periodic function should have run again after it failed"
    assert engine.stats().num_blocks_in_use == 0


def test_recorded_steps_have_the_planned_shapes_and_times_and_stop_when_asked(engine):
    """``record_steps``: every step's shape (prefill, then one-token decodes) and a wall time;
    ``take_steps`` hands each over once; a limit keeps the latest; 0 stops recording."""
    runtime = AsyncEngine(engine)

    async def generate(rid, n, token):
        async for _ in runtime.generate([token] * 20, _params(n), rid):  # a prompt of its own: no cache hit
            pass
        # A call runs on the step thread's next turn: the one that stepped last is over.
        await runtime.call(lambda: None)
        return runtime.take_steps()

    async def main():
        runtime.record_steps(1000)
        first = await generate("rec-1", 4, 31)
        again = runtime.take_steps()
        runtime.record_steps(2)
        latest = await generate("rec-2", 5, 32)
        runtime.record_steps(0)
        stopped = await generate("rec-3", 3, 33)
        return first, again, latest, stopped

    first, again, latest, stopped = asyncio.run(main())
    runtime.shutdown()
    shapes = [shape for shape, _, _ in first]
    assert [(s.batch, s.num_tokens, s.prefill_tokens, s.num_sampled) for s in shapes] == (
        [(1, 20, 20, 1)] + [(1, 1, 0, 1)] * 3), shapes
    assert [s.kv_read_tokens for s in shapes] == [20, 21, 22, 23]
    starts = [start for _, start, _ in first]
    assert starts == sorted(starts) and all(seconds > 0 for _, _, seconds in first)
    assert again == []  # taken once
    assert [shape.kv_read_tokens for shape, _, _ in latest] == [23, 24]  # the latest two
    assert stopped == []
    assert engine.stats().num_blocks_in_use == 0
