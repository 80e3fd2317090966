"""A request's ``priority`` through the worker RPCs into the engine's scheduler, on a
worker built in this process (no Ray): under the ``priority`` policy it orders the
waiting queue. Every test ends with the worker's KV blocks all free."""

from __future__ import annotations

import asyncio

from engine import SamplingParams
from engine.config import EngineConfig
from kv_transfer.config import TransferConfig
from tests.helpers import PATIENCE_S, async_wait_for

PROMPT = [5, 6, 7, 8, 9]


def _scheduled(worker) -> tuple[dict[str, int], str | None]:
    """(request id -> priority of each request the engine holds, the next one to run)."""
    scheduler = worker.engine.scheduler
    nxt = scheduler.waiting.peek()
    return {rid: r.priority for rid, r in scheduler.requests.items()}, nxt and nxt.request_id


def test_submit_and_reserve_hand_the_priority_to_the_scheduler_which_runs_the_lowest_first(default_model):
    from decode_worker.worker import ColocatedWorker

    config = EngineConfig(model=str(default_model), num_kv_blocks=64, max_num_seqs=1, policy="priority")
    worker = ColocatedWorker("colocated-0", config, TransferConfig(backend="inprocess"))
    short = SamplingParams(max_tokens=1)
    long = SamplingParams(max_tokens=worker.engine.max_model_len - len(PROMPT) - 1, ignore_eos=True)

    async def running() -> int:
        return await worker.async_engine.call(lambda: worker.engine.load().num_running)

    async def main():
        await worker.submit("first", PROMPT, long, subscriber="sub", priority=9)
        await async_wait_for(running, PATIENCE_S, "the first request to run")  # one at a time: the rest wait
        for rid, priority in (("a", 0), ("b", 5), ("c", -1)):
            await worker.submit(rid, PROMPT, short, subscriber="sub", priority=priority)
        await worker.reserve("remote", PROMPT, short, subscriber="sub", priority=-3)
        seen = await worker.async_engine.call(_scheduled, worker)
        for rid in ("first", "a", "b", "c", "remote"):
            await worker.abort(rid)
        in_use = await worker.async_engine.call(lambda: worker.engine.stats().num_blocks_in_use)
        worker.async_engine.shutdown()
        return seen, in_use

    (priorities, nxt), in_use = asyncio.run(main())
    assert priorities == {"first": 9, "a": 0, "b": 5, "c": -1, "remote": -3}, priorities
    assert nxt == "c", f"c has the lowest priority value of those waiting, but {nxt} is next"
    assert in_use == 0, f"{in_use} KV blocks still held after the aborts"
