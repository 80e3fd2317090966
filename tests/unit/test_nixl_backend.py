"""The NIXL backend inside one process: two agents, many reading threads at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kv_transfer import KVLayout, TransferError, TransferMeta
from kv_transfer.nixl import unavailable_reason
from kv_transfer.peer import checksum, make_kv

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
