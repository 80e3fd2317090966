"""``kv_transfer.packed``: a packed backend seen as a paged one, as every worker sees it."""

from __future__ import annotations

import asyncio
import time

from engine.wire.messages import KVLayout
from kv_transfer.base import TransferMeta
from kv_transfer.config import TransferConfig
from kv_transfer.faults import FaultConfig, FaultyBackend
from kv_transfer.inprocess import InProcessBackend
from kv_transfer.packed import PackedAsPaged, as_paged, reconfigure
from kv_transfer.peer import checksum
from tests.helpers import cache_blocks, paged_pair

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def test_offered_blocks_land_in_the_reserved_ones_and_nowhere_else():
    shared = InProcessBackend()  # one registry: sender and receiver in one process
    with paged_pair(lambda: PackedAsPaged(shared), LAYOUT, 16, 32) as (sender, src, receiver, dst):
        untouched = checksum(*cache_blocks(dst, [0, 1, 2, 9, 10]))
        meta = TransferMeta("t", "r", LAYOUT, 3, 12, deadline=time.time() + 30, dst_blocks=(5, 6, 8))
        payload = sender.prepare_blocks(meta, [3, 7, 4])
        src_before = checksum(*cache_blocks(src, [3, 7, 4]))
        src[0][:, 3] += 1.0  # the offer is a copy made when offered: later writes do not travel
        asyncio.run(receiver.pull_blocks_async(meta, payload, [5, 6, 8]))
        sender.release(meta, payload)
        assert checksum(*cache_blocks(dst, [5, 6, 8])) == src_before
        assert checksum(*cache_blocks(dst, [0, 1, 2, 9, 10])) == untouched
        assert shared.num_held == 0 and not sender._sent, "release drops the packed copy"


def test_workers_get_paged_backends_whatever_the_setting_and_faults_reach_the_wrapped_one():
    packed = as_paged(TransferConfig(backend="object_store").make_backend())
    assert packed.paged and isinstance(packed, PackedAsPaged) and packed.name == "object_store"
    faulty = reconfigure(packed, TransferConfig(backend="object_store", faults=FaultConfig(drop_rate=1.0)))
    assert faulty is packed and isinstance(packed.inner, FaultyBackend)
    bare = packed.inner.inner
    assert reconfigure(packed, TransferConfig(backend="object_store")).inner is bare, "faults off: the bare backend"
    paged = TransferConfig(backend="collective").make_backend()
    assert as_paged(paged) is paged
