"""The collective backend's paged transfers: messages from the sender's blocks straight
into the receiver's reserved ones, two backends in one process (a gloo pair needs no
more), over each kind of channel: gloo, and NCCL's (its bodies over
``tests.nccl_fakes.FakeNcclPair``, CPU memory matched in posting order as NCCL matches).
Checked by sha256 of the bytes: blocks land where they were reserved and nowhere else,
concurrent transfers keep to their own blocks, blocks too scattered for one message per
stretch go packed and land the same, and offers that do not fit are refused before any
byte moves.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.wire.messages import KVLayout
from kv_transfer import collective, collective_channels, nccl_channel
from kv_transfer.base import TransferError, TransferMeta
from kv_transfer.collective import BlockPlan, CollectiveBackend
from kv_transfer.peer import checksum
from tests.helpers import cache_blocks, paged_pair
from tests.nccl_fakes import FakeNcclPair

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
SRC_BLOCKS, DST_BLOCKS = 40, 64


@pytest.fixture(scope="module", params=["gloo", "nccl"])
def pair(request):
    """(sender, its cache, receiver, its cache), caches attached, over one kind of channel."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nccl_channel, "NcclPair", FakeNcclPair.reset())
        patch.setattr(collective, "channel_kind", _as_preferred)  # as if on two GPUs
        make = lambda: CollectiveBackend(op_timeout_s=20, channel=request.param)  # noqa: E731
        with paged_pair(make, LAYOUT, SRC_BLOCKS, DST_BLOCKS) as pair:
            assert pair[0].paged and pair[2].paged, "on CPUs the collective backend moves blocks"
            yield pair
        assert not any(w.errors for w in FakeNcclPair.wires.values()), "NCCL calls posted out of order"
        if request.param == "nccl":
            assert any(op == "send" for _, op, _ in FakeNcclPair.posts), "the bodies should have gone over NCCL"


def _as_preferred(preferred: str, mine: str, theirs: str) -> str:
    return preferred


def _meta(tid: str, receiver: CollectiveBackend, dst_ids: list[int]) -> TransferMeta:
    return TransferMeta(tid, tid, LAYOUT, len(dst_ids), len(dst_ids) * LAYOUT.block_size,
                        dst_endpoint=receiver.endpoint, deadline=time.time() + 30, dst_blocks=tuple(dst_ids))


def _move(sender, receiver, meta: TransferMeta, src_ids: list[int], dst_ids: list[int]) -> None:
    payload = sender.prepare_blocks(meta, src_ids)
    with ThreadPoolExecutor(1) as pool:
        push = pool.submit(sender.push, meta, None, None, payload)
        receiver.pull_blocks(meta, payload, dst_ids)
        push.result(timeout=30)


def test_blocks_land_in_the_reserved_blocks_and_nowhere_else(pair):
    sender, src, receiver, dst = pair
    src_ids, dst_ids = [7, 8, 9, 30, 2, 3], [40, 41, 12, 13, 14, 60]
    plan = BlockPlan(src_ids, dst_ids, dst[0])
    assert plan.direct and plan.num_messages == 2 * LAYOUT.num_layers * 5, "5 stretches, per layer, K and V"
    others = [i for i in range(DST_BLOCKS) if i not in dst_ids]
    before = checksum(*cache_blocks(dst, others))
    received = receiver.stats.bytes_received
    _move(sender, receiver, _meta("direct", receiver, dst_ids), src_ids, dst_ids)
    assert checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids)), "the blocks received differ"
    assert checksum(*cache_blocks(dst, others)) == before, "a transfer wrote outside its reserved blocks"
    assert receiver.stats.bytes_received - received == LAYOUT.nbytes(len(dst_ids))


def test_blocks_too_scattered_for_a_message_each_go_packed(pair, monkeypatch):
    sender, src, receiver, dst = pair
    monkeypatch.setattr(collective_channels, "MAX_MESSAGES", 8)
    src_ids, dst_ids = [1, 5, 9, 13, 17], [50, 48, 46, 44, 42]
    plan = BlockPlan(src_ids, dst_ids, dst[0])
    assert not plan.direct and plan.num_messages == 2
    others = [i for i in range(DST_BLOCKS) if i not in dst_ids]
    before = checksum(*cache_blocks(dst, others))
    _move(sender, receiver, _meta("packed", receiver, dst_ids), src_ids, dst_ids)
    assert checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids)), "the blocks received differ"
    assert checksum(*cache_blocks(dst, others)) == before, "a transfer wrote outside its reserved blocks"


def test_concurrent_transfers_each_fill_their_own_blocks(pair):
    sender, src, receiver, dst = pair
    rng = __import__("random").Random(11)
    jobs = []
    for i in range(12):
        n = 1 + i % 4  # 12 transfers of up to 4 blocks into disjoint destinations
        src_ids, dst_ids = rng.sample(range(SRC_BLOCKS), n), [4 * i + j for j in range(n)]
        jobs.append((_meta(f"c{i}", receiver, dst_ids), src_ids, dst_ids))
    payloads = [sender.prepare_blocks(meta, s) for meta, s, _ in jobs]
    with ThreadPoolExecutor(24) as pool:
        pulls = [pool.submit(receiver.pull_blocks, meta, p, d) for (meta, _, d), p in zip(jobs, payloads)]
        # Pushed in reverse order: each receive still gets its own transfer's bytes.
        pushes = [pool.submit(sender.push, meta, None, None, p) for (meta, _, _), p in reversed(list(zip(jobs, payloads)))]
        for f in pulls + pushes:
            f.result(timeout=60)
    wrong = [meta.transfer_id for meta, s, d in jobs if checksum(*cache_blocks(dst, d)) != checksum(*cache_blocks(src, s))]
    assert not wrong, f"transfers {wrong} delivered other bytes"


@pytest.mark.parametrize(
    "offered,reserved,announced,why",
    [
        ([1, 2, 3], [4, 5], [4, 5], "reserved"),
        ([1, 2], [4, 5], [4, 6], "sent for blocks"),
        ([1, 2], [4, DST_BLOCKS], [4, DST_BLOCKS], "outside this cache"),
    ],
    ids=["counts-differ", "split-for-other-blocks", "receiver-out-of-range"],
)
def test_offers_that_do_not_fit_are_refused_before_any_byte_lands(pair, offered, reserved, announced, why):
    sender, _, receiver, dst = pair
    before = checksum(*dst)
    meta = TransferMeta(f"bad-{why}", "bad", LAYOUT, len(reserved), 8, dst_endpoint=receiver.endpoint,
                        deadline=time.time() + 30, dst_blocks=tuple(announced))
    payload = {"sender": sender.sender_id, "epoch": 0, "tag": 10**6, "blocks": tuple(offered)}
    with pytest.raises(TransferError) as info:
        receiver.pull_blocks(meta, payload, reserved)
    assert info.value.reason == "layout" and why in str(info.value)
    assert checksum(*dst) == before, "a refused transfer must not write anything"


def test_a_header_for_other_blocks_is_refused_and_the_pair_recovers(pair):
    sender, src, receiver, dst = pair
    src_ids, dst_ids = [20, 21], [30, 31]
    meta = _meta("misannounced", receiver, dst_ids)
    payload = sender.prepare_blocks(meta, src_ids)
    # The receiver was told of other sender blocks than the sender sends: the header's
    # hash of both block lists differs, so no byte of the body lands in the blocks.
    told = {**payload, "blocks": (22, 23)}
    before = checksum(*cache_blocks(dst, dst_ids))
    with ThreadPoolExecutor(1) as pool:
        push = pool.submit(sender.push, meta, None, None, payload)
        with pytest.raises(TransferError, match="header"):
            receiver.pull_blocks(meta, told, dst_ids)
        push.result(timeout=30)  # the receiver drained its messages: the send ends, the channel stays
    assert checksum(*cache_blocks(dst, dst_ids)) == before, "a refused transfer must not write anything"
    again = _meta("after-refusal", receiver, dst_ids)
    assert sender.prepare_blocks(again, src_ids)["epoch"] == payload["epoch"], "a refusal keeps the channel"
    _move(sender, receiver, again, src_ids, dst_ids)
    assert checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids))


def test_a_receive_past_its_deadline_fails_and_writes_nothing_after(pair):
    sender, src, receiver, dst = pair
    src_ids, dst_ids = [10, 11, 12], [20, 21, 22]
    meta = TransferMeta("late", "late", LAYOUT, 3, 12, dst_endpoint=receiver.endpoint,
                        deadline=time.time() + 1.0, dst_blocks=tuple(dst_ids))
    payload = sender.prepare_blocks(meta, src_ids)
    before = checksum(*cache_blocks(dst, dst_ids))
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        receiver.pull_blocks(meta, payload, dst_ids)  # nobody sends
    assert info.value.reason == "timeout" and time.monotonic() - t0 < 10
    # The receiver closed the channel: a send that comes late fails (at once, or at its
    # own deadline) instead of landing.
    with pytest.raises(TransferError):
        sender.push(dataclasses.replace(meta, deadline=time.time() + 2), None, None, payload)
    assert checksum(*cache_blocks(dst, dst_ids)) == before, "no byte may land after the receive gave up"
    _move(sender, receiver, _meta("after-deadline", receiver, dst_ids), src_ids, dst_ids)
    assert checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids))


def test_receives_from_a_sender_that_never_connects_fail_by_their_deadline(pair):
    _, _, receiver, dst = pair
    dst_ids = [50, 51]
    meta = TransferMeta("ghost", "ghost", LAYOUT, 2, 8, dst_endpoint=receiver.endpoint,
                        deadline=time.time() + 2.0, dst_blocks=tuple(dst_ids))
    payload = {"sender": "a-sender-that-died", "epoch": 0, "tag": 0, "blocks": (1, 2)}
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:  # several transfers waiting on the one channel build
        pulls = [pool.submit(receiver.pull_blocks, meta, payload, dst_ids) for _ in range(3)]
        errors = [f.exception(timeout=30) for f in pulls]
    assert all(isinstance(e, TransferError) for e in errors), errors
    assert time.monotonic() - t0 < 8, f"the receives took {time.monotonic() - t0:.1f} s, past their 2 s deadline"
