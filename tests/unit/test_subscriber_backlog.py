"""A subscriber's backlog on a decode worker: outputs its router has not taken yet.

The outbox keeps deltas only (no full-text snapshot per output), a router that lets
its backlog pass ``max_pending_outputs`` is told, and one that stays past it (or
passes twice it) is cut off: its requests aborted, their blocks freed. Workers are
built in this process (no Ray); time is the ``now`` the step thread hands in.
"""

from __future__ import annotations

import asyncio

from decode_worker.outbox import Outbox
from engine import SamplingParams
from engine.async_engine import merge_outputs
from engine.config import EngineConfig
from engine.llm_engine import RequestOutput
from engine.wire.token_channel import ChannelConfig, Notice, NoticeKind
from kv_transfer.config import TransferConfig
from tests.helpers import PATIENCE_S, async_wait_for

PROMPT = list(range(5, 25))


def _output(i: int, text: str) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[], text=text, new_token_ids=[i],
                         new_text=text[-1], finished=False)


def test_an_outbox_keeps_each_outputs_delta_but_not_its_snapshot_of_the_whole_text():
    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        reader = outbox.claim()
        for i in range(200):
            outbox.add("r", _output(i, "x" * i + "y"))  # the engine's ``text``: everything so far
        outbox.signal()
        return await outbox.take(reader), outbox.taken

    pending, taken = asyncio.run(main())
    items = pending["r"]
    assert taken == 200 and len(items) == 200
    assert sum(len(o.text) for o in items) == 0, "a pending output must not hold the text so far"
    assert merge_outputs(items).new_text == "y" * 200, "the deltas must survive"


def test_an_outbox_is_due_for_cutting_once_past_its_bound_for_the_patience_or_past_twice_it():
    loop = asyncio.new_event_loop()
    slow, flooded = Outbox(loop), Outbox(loop)
    for i in range(5):
        slow.add("r", _output(i, "a"))
    assert not slow.backlog(100.0, limit=4, patience_s=5.0), "just past the bound: told, not cut yet"
    assert not slow.backlog(104.9, limit=4, patience_s=5.0)
    assert slow.backlog(105.0, limit=4, patience_s=5.0), "still past it after the patience: cut"
    for i in range(9):
        flooded.add("r", _output(i, "a"))
    assert flooded.backlog(100.0, limit=4, patience_s=5.0), "past twice the bound: cut at once"
    flooded.cut_off()
    flooded.add("r", _output(9, "a"))
    assert not flooded.backlog(101.0, limit=4, patience_s=5.0), "a cut outbox drops what it held, and takes nothing"
    loop.run_until_complete(asyncio.sleep(0))  # the wake-up the cut queued
    loop.close()


def test_an_outbox_its_reader_empties_starts_its_patience_anew():
    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        reader = outbox.claim()
        for i in range(5):
            outbox.add("r", _output(i, "a"))
        outbox.signal()
        first = outbox.backlog(0.0, limit=4, patience_s=5.0)
        await outbox.take(reader)
        for i in range(5):
            outbox.add("r", _output(i, "a"))
        return first, outbox.backlog(6.0, limit=4, patience_s=5.0)

    assert asyncio.run(main()) == (False, False), "the patience counts from when it passed the bound again"


def _worker(model: str, **channel):
    from decode_worker.worker import ColocatedWorker

    config = EngineConfig(model=model, num_kv_blocks=32, block_size=16)
    return ColocatedWorker("decode-0", config, TransferConfig(backend="inprocess"), channel=ChannelConfig(**channel))


def test_a_stalled_subscriber_is_cut_off_and_its_requests_aborted(tiny_model):
    worker = _worker(tiny_model, max_pending_outputs=4, slow_subscriber_s=60.0)

    async def main():
        messages = worker._step_messages("sub")
        first = asyncio.create_task(anext(messages))
        for rid in ("a", "b"):
            await worker.submit(rid, PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), subscriber="sub")
        got = [await first]  # and then the reader stalls
        await async_wait_for(lambda: worker.num_cut_off == 1, PATIENCE_S, "the stalled subscriber to be cut off")
        left = await worker.async_engine.call(lambda: sorted(worker.engine.scheduler.requests))
        in_use = await worker.async_engine.call(lambda: worker.engine.stats().num_blocks_in_use)
        got += [m async for m in messages]  # the reader comes back: what is left for it
        worker.async_engine.shutdown()
        return got, left, in_use

    got, left, in_use = asyncio.run(main())
    assert left == [] and in_use == 0, f"requests {left} and {in_use} blocks outlived the cut"
    assert isinstance(got[-1], Notice) and got[-1].kind is NoticeKind.CUT, f"the stream must end told why: {got[-1]}"
    tokens = sum(len(item[1]) for m in got if not isinstance(m, Notice) for item in m[1])
    assert tokens < 2 * 200, "the requests must have been stopped, not run to their end"


def test_a_subscriber_whose_backlog_passed_the_bound_is_told_with_its_next_message(tiny_model):
    worker = _worker(tiny_model, max_pending_outputs=4, slow_subscriber_s=60.0)

    async def main():
        await worker.submit("a", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), subscriber="sub")
        await async_wait_for(lambda: worker.async_engine.call(lambda: "a" not in worker.engine.scheduler.requests),
                             PATIENCE_S, "the request to finish with nobody reading")
        messages = worker._step_messages("sub")
        got = [await anext(messages), await anext(messages)]
        await messages.aclose()
        worker.async_engine.shutdown()
        return got

    notice, (_, items) = asyncio.run(main())
    assert isinstance(notice, Notice) and notice.kind is NoticeKind.SLOW, notice
    assert worker.num_cut_off == 0, "8 waiting of a bound of 4 is within twice it, and the patience is long"
    assert [(rid, len(ids), done) for rid, ids, _, done, *_ in items] == [("a", 8, True)], "nothing lost"
