"""The exported KV usage gauge agrees with the block pool at idle and after every
release, on workers built in this process (no Ray). Blocks are freed and reserved
between engine steps (a transfer's end, an abort, a reservation), when no step may come
to export them: ``tandem:kv_cache_usage_perc`` must not keep the last step's value."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from engine.wire.messages import Reservation, TransferState
from tests.unit.test_handoff_workers import GREEDY, PROMPT, _decode_worker, _FakeDecodeHandle, _prefill_worker


def _exported_usage(worker) -> float | None:
    """The gauge as a scrape would read it from this process's registry."""
    labels = dict(zip(("model", "role", "worker"), worker.metrics.labels))
    return REGISTRY.get_sample_value("tandem:kv_cache_usage_perc", labels)


async def _pool_usage(worker) -> tuple[int, float]:
    stats = await worker.async_engine.call(worker.engine.stats)
    return stats.num_blocks_in_use, stats.kv_cache_usage


def test_a_prefill_workers_gauge_is_zero_once_its_last_hand_off_released_its_blocks(tiny_model):
    """Sequential prefills hold their blocks past their last step, until the reader
    answers: after each release the gauge reads the pool's usage, 0 at idle. Free blocks
    that still hold a prefix-cache entry count as free."""
    worker = _prefill_worker(tiny_model, pipeline=False)
    decode = _FakeDecodeHandle()

    async def main():
        seen = []
        for i in range(3):
            prompt = [100 + i] + PROMPT[1:]  # a prompt each, so each fills blocks of its own
            reservation = Reservation(f"a{i}", [1, 2, 3], worker.layout, "", time.time() + 3600)
            result = await worker.prefill(f"a{i}", prompt, GREEDY, decode_worker=decode, reservation=reservation)
            in_use, usage = await _pool_usage(worker)  # queued after the release: it has run
            seen.append((result.state, in_use, usage, _exported_usage(worker)))
        cached = await worker.async_engine.call(lambda: len(worker.engine.kv_manager.pool._cached))
        worker.async_engine.shutdown()
        return seen, cached

    seen, cached = asyncio.run(main())
    for i, (state, in_use, usage, exported) in enumerate(seen):
        assert state == TransferState.DONE, f"prefill {i} should have been handed over"
        assert in_use == 0 and usage == 0.0, f"prefill {i}: {in_use} blocks still held in the pool"
        assert exported == usage, f"prefill {i}: the gauge reads {exported}, the pool {usage}"
    assert cached > 0, "the released blocks stay in the prefix cache (and count as free)"


def test_a_decode_workers_gauge_follows_a_reservation_and_its_abort_with_no_step(tiny_model):
    """A reservation takes blocks and its abort frees them, both between steps (nothing
    is ever scheduled here): the gauge shows the reserved blocks, then 0."""
    worker = _decode_worker(tiny_model)

    async def main():
        reservation = await worker.reserve("a", PROMPT, GREEDY, subscriber="sub")
        reserved = await _pool_usage(worker), _exported_usage(worker)
        await worker.abort("a")
        aborted = await _pool_usage(worker), _exported_usage(worker)
        steps = await worker.async_engine.call(lambda: worker.engine.stats().num_steps)
        worker.async_engine.shutdown()
        return reservation, reserved, aborted, steps

    reservation, reserved, aborted, steps = asyncio.run(main())
    (in_use, usage), exported = reserved
    (in_use_after, usage_after), exported_after = aborted
    assert steps == 0, "no step may have run: the gauge must not depend on one"
    assert in_use == len(reservation.block_ids) == 3
    assert exported == usage > 0, f"after the reservation the gauge reads {exported}, the pool {usage}"
    assert in_use_after == 0 and exported_after == usage_after == 0.0, (
        f"after the abort the gauge reads {exported_after}, the pool {usage_after} ({in_use_after} blocks)"
    )
