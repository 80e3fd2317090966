"""The NIXL backend inside one process: two agents, many reading threads at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kv_transfer import KVLayout, TransferError, TransferMeta
from kv_transfer.nixl import unavailable_reason
from kv_transfer.peer import checksum, make_kv
from tests.helpers import cache_blocks, paged_pair

NIXL_MISSING = unavailable_reason()
pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl unavailable: {NIXL_MISSING}")

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


@pytest.fixture(scope="module")
def pair():
    from kv_transfer.nixl import NixlBackend

    return NixlBackend(), NixlBackend(max_staging=4)


def _meta(tid: str, num_blocks: int) -> TransferMeta:
    return TransferMeta(tid, tid, LAYOUT, num_blocks, num_blocks * 16, deadline=time.time() + 30)


def test_concurrent_pulls_each_get_their_own_bytes(pair):
    sender, receiver = pair

    def one(i: int) -> bool:
        meta = _meta(f"c{i}", 1 + i % 7)
        k, v = make_kv(LAYOUT, meta.num_blocks, seed=i)
        payload = sender.prepare(meta, k, v)
        k2, v2 = receiver.pull(meta, payload)
        same = checksum(k2, v2) == checksum(k, v)
        receiver.recycle(k2, v2)
        sender.release(meta, payload)
        return same

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(96)))
    assert all(results), f"{results.count(False)} of 96 concurrent transfers delivered other bytes"
    assert sender.num_held == 0, "every released transfer must be deregistered"
    assert receiver.staging_in_use == 0, "every recycled staging buffer must be back"
    assert len(receiver._staging._free) <= 4, "the pool keeps at most max_staging idle buffers"


def test_staging_buffers_are_reused(pair):
    sender, receiver = pair
    ptrs = set()
    for i in range(5):
        meta = _meta(f"r{i}", 3)
        k, v = make_kv(LAYOUT, 3, seed=i)
        payload = sender.prepare(meta, k, v)
        k2, v2 = receiver.pull(meta, payload)
        ptrs.add(k2.untyped_storage().data_ptr())
        receiver.recycle(k2, v2)
        sender.release(meta, payload)
    assert len(ptrs) == 1, "sequential pulls of one size should reuse one registered buffer"


def test_a_pull_past_its_deadline_reads_nothing(pair):
    sender, receiver = pair
    meta = TransferMeta("late", "late", LAYOUT, 2, 32, deadline=time.time() - 1)
    k, v = make_kv(LAYOUT, 2, seed=1)
    payload = sender.prepare(meta, k, v)
    with pytest.raises(TransferError) as info:
        receiver.pull(meta, payload)
    assert info.value.reason == "timeout"
    assert receiver.staging_in_use == 0
    sender.release(meta, payload)


def test_transfers_go_on_across_the_periodic_reconnect(pair, monkeypatch):
    import kv_transfer.nixl as nixl

    sender, receiver = pair
    monkeypatch.setattr(nixl, "REFRESH_AFTER_LOADS", 2)  # reconnect every other transfer
    for i in range(6):
        meta = _meta(f"f{i}", 2)
        k, v = make_kv(LAYOUT, 2, seed=40 + i)
        payload = sender.prepare(meta, k, v)
        k2, v2 = receiver.pull(meta, payload)
        assert checksum(k2, v2) == checksum(k, v), f"transfer {i} after a reconnect differs"
        receiver.recycle(k2, v2)
        sender.release(meta, payload)
    assert receiver._peers[sender._agent().name].loads <= 2, "the peer's loaded regions were dropped"


def test_close_deregisters_everything_and_a_later_transfer_starts_afresh():
    from kv_transfer.nixl import NixlBackend

    sender, receiver = NixlBackend(), NixlBackend()
    meta = _meta("closing", 2)
    k, v = make_kv(LAYOUT, 2, seed=7)
    payload = sender.prepare(meta, k, v)
    k2, v2 = receiver.pull(meta, payload)
    receiver.recycle(k2, v2)
    sender.close()
    receiver.close()
    assert sender.num_held == 0 and receiver.staging_in_use == 0
    meta = _meta("after-close", 2)
    payload = sender.prepare(meta, k, v)  # a new agent, under a new name
    k2, v2 = receiver.pull(meta, payload)
    assert checksum(k2, v2) == checksum(k, v)
    receiver.recycle(k2, v2)
    sender.release(meta, payload)


# -- paged: blocks read straight out of one paged cache into another ---------------------

SRC_BLOCKS, DST_BLOCKS = 48, 64


@pytest.fixture(scope="module")
def paged():
    """(sender backend, its cache, receiver backend, its cache), caches attached."""
    from kv_transfer.nixl import NixlBackend

    with paged_pair(NixlBackend, LAYOUT, SRC_BLOCKS, DST_BLOCKS) as pair:
        yield pair


def test_contiguous_runs_merge_stretches_that_rise_together_on_both_sides():
    from kv_transfer.base import contiguous_runs

    src, dst = contiguous_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 8])
    assert src.tolist() == [[4, 3], [9, 2], [2, 1]]
    assert dst.tolist() == [[0, 3], [3, 2], [8, 1]]


def test_blocks_land_in_the_reserved_blocks_and_nowhere_else(paged):
    sender, src, receiver, dst = paged
    src_ids, dst_ids = [7, 8, 9, 30, 2, 3], [40, 41, 12, 13, 14, 60]
    before = cache_blocks(dst, [i for i in range(DST_BLOCKS) if i not in dst_ids])
    meta = _meta("p0", len(src_ids))
    payload = sender.prepare_blocks(meta, src_ids)
    receiver.pull_blocks(meta, payload, dst_ids)
    assert checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids)), "the blocks read differ"
    after = cache_blocks(dst, [i for i in range(DST_BLOCKS) if i not in dst_ids])
    assert checksum(*after) == checksum(*before), "a read wrote outside its reserved blocks"
    sender.release(meta, payload)


def test_concurrent_block_reads_each_fill_their_own_blocks(paged):
    sender, src, receiver, dst = paged
    rng = __import__("random").Random(11)

    def one(i: int) -> bool:
        n = 1 + i % 4  # 16 transfers x up to 4 blocks: disjoint destinations below
        src_ids = rng.sample(range(SRC_BLOCKS), n)
        dst_ids = [4 * (i % 16) + j for j in range(n)]
        meta = _meta(f"pc{i}", n)
        payload = sender.prepare_blocks(meta, src_ids)
        receiver.pull_blocks(meta, payload, dst_ids)
        sender.release(meta, payload)
        return checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    assert all(results), f"{results.count(False)} of 16 concurrent block reads delivered other bytes"


@pytest.mark.parametrize(
    "offered,reserved,why",
    [([1, 2, 3], [4, 5], "reserved"), ([1, SRC_BLOCKS], [4, 5], "sender's cache"), ([1, 2], [4, DST_BLOCKS], "this cache")],
    ids=["counts-differ", "sender-out-of-range", "receiver-out-of-range"],
)
def test_offers_that_do_not_fit_are_refused_before_any_read(paged, offered, reserved, why):
    sender, _, receiver, dst = paged
    before = checksum(*dst)
    meta = _meta(f"bad-{why}", len(offered))
    payload = sender.prepare_blocks(meta, offered)
    with pytest.raises(TransferError) as info:
        receiver.pull_blocks(meta, payload, reserved)
    assert info.value.reason == "layout" and why in str(info.value)
    assert checksum(*dst) == before, "a refused transfer must not write anything"
    sender.release(meta, payload)


def test_a_packed_payload_is_refused_by_a_paged_read(paged, pair):
    _, _, receiver, dst = paged
    meta = _meta("mixed", 2)
    k, v = make_kv(LAYOUT, 2, seed=5)
    payload = pair[0].prepare(meta, k, v)
    with pytest.raises(TransferError, match="not a paged nixl payload"):
        receiver.pull_blocks(meta, payload, [0, 1])
    pair[0].release(meta, payload)


@pytest.mark.parametrize("ends", ["returns", "fails after cancelling", "stuck"])
def test_a_read_given_up_as_stuck_settles_only_once_it_is_over(monkeypatch, ends):
    """A read still running past its deadline and grace is reported "stuck" (its blocks
    are quarantined); the error's ``settled`` completes when the read's call ends with the
    read over, and never when the call itself ends "stuck" (the read could not be
    cancelled: only the sender's going can end the quarantine)."""
    import asyncio
    import threading

    from kv_transfer import nixl
    from kv_transfer.nixl import NixlBackend

    monkeypatch.setattr(nixl, "STUCK_GRACE_S", 0.0)
    backend = NixlBackend()
    release = threading.Event()

    def read():
        release.wait(timeout=30)
        if ends == "fails after cancelling":
            raise TransferError("timeout", "cancelled at its deadline")
        if ends == "stuck":
            raise TransferError("stuck", "could not be cancelled")

    async def main():
        meta = TransferMeta("t", "r", LAYOUT, 1, LAYOUT.block_size, deadline=time.time() + 0.05)
        with pytest.raises(TransferError) as e:
            await backend._until_ended(meta, read)
        settled = e.value.settled
        before = settled.done()
        release.set()
        try:
            await asyncio.wait_for(asyncio.shield(settled), 2.0 if ends != "stuck" else 0.5)
        except asyncio.TimeoutError:
            pass
        return e.value.reason, before, settled.done()

    reason, before, after = asyncio.run(main())
    backend.close()
    assert reason == "stuck" and not before, "the read was still running when it was given up"
    assert after == (ends != "stuck")
