"""The collective backend's NCCL pair channel (``kv_transfer.nccl_channel``): headers and
answers over the pair's gloo channel, bodies over a two-rank NCCL communicator that
matches in posting order, here ``tests.nccl_fakes.FakeNcclPair`` on CPU memory.

What the turn protocol must keep: transfers received in another order than they were
pushed still land whole (both sides post their NCCL calls in the receiver's order); a
refused header costs no body (nothing is posted on NCCL for it) and leaves the channel
whole; a transfer whose time runs out waiting for the turn fails alone; a sender that
froze after posting fails the receive by its deadline, the communicator is aborted (no
byte lands after), and the pair's next transfer goes on a new epoch. The real NCCL pair
needs two GPUs: ``tests/gpu/test_nccl_channel.py``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.wire.messages import KVLayout
from kv_transfer import collective, nccl_channel
from kv_transfer.base import TransferError, TransferMeta
from kv_transfer.collective import CollectiveBackend
from kv_transfer.collective_channels import channel_kind, default_channel
from kv_transfer.peer import checksum
from tests.helpers import cache_blocks, paged_pair
from tests.nccl_fakes import FakeNcclPair

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
SRC_BLOCKS, DST_BLOCKS = 24, 32


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(nccl_channel, "NcclPair", FakeNcclPair.reset())
    monkeypatch.setattr(collective, "channel_kind", lambda preferred, mine, theirs: preferred)  # as on two GPUs
    make = lambda: CollectiveBackend(op_timeout_s=20, channel="nccl")  # noqa: E731
    with paged_pair(make, LAYOUT, SRC_BLOCKS, DST_BLOCKS) as pair:
        yield pair
    assert not any(w.errors for w in FakeNcclPair.wires.values()), [w.errors for w in FakeNcclPair.wires.values()]


def _meta(tid: str, receiver, dst_ids: list[int], deadline_s: float = 30) -> TransferMeta:
    return TransferMeta(tid, tid, LAYOUT, len(dst_ids), len(dst_ids) * LAYOUT.block_size,
                        dst_endpoint=receiver.endpoint, deadline=time.time() + deadline_s, dst_blocks=tuple(dst_ids))


def _arrived(src, dst, src_ids, dst_ids) -> bool:
    return checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids))


def _move(sender, receiver, meta: TransferMeta, src_ids: list[int]) -> dict:
    payload = sender.prepare_blocks(meta, src_ids)
    with ThreadPoolExecutor(1) as pool:
        pull = pool.submit(receiver.pull_blocks, meta, payload, list(meta.dst_blocks))
        sender.push(meta, None, None, payload)
        pull.result(timeout=30)
    return payload


def _sends() -> int:
    return sum(op == "send" for _, op, _ in FakeNcclPair.posts)


def test_transfers_received_in_another_order_than_pushed_land_whole(pair):
    sender, src, receiver, dst = pair
    jobs = [(_meta(f"t{i}", receiver, [3 * i, 3 * i + 1]), [i, i + 10]) for i in range(4)]
    payloads = [sender.prepare_blocks(meta, src_ids) for meta, src_ids in jobs]
    with ThreadPoolExecutor(8) as pool:
        pulls = [pool.submit(receiver.pull_blocks, m, p, list(m.dst_blocks)) for (m, _), p in reversed(list(zip(jobs, payloads)))]
        pushes = [pool.submit(sender.push, m, None, None, p) for (m, _), p in zip(jobs, payloads)]
        for f in pulls + pushes:
            f.result(timeout=30)
    wrong = [m.transfer_id for m, s in jobs if not _arrived(src, dst, s, list(m.dst_blocks))]
    assert not wrong, f"{wrong} did not land whole"
    assert _sends() == len(jobs) and sender.num_channels == 1
    assert sender.stats.bytes_sent == receiver.stats.bytes_received == sum(LAYOUT.nbytes(2) for _ in jobs)


def test_a_refused_header_posts_no_body_and_leaves_the_channel_whole(pair):
    sender, src, receiver, dst = pair
    meta = _meta("misannounced", receiver, [4, 5])
    payload = sender.prepare_blocks(meta, [6, 7])
    before = checksum(*cache_blocks(dst, [4, 5]))
    with ThreadPoolExecutor(1) as pool:
        push = pool.submit(sender.push, meta, None, None, payload)
        with pytest.raises(TransferError, match="header"):
            receiver.pull_blocks(meta, {**payload, "blocks": (8, 9)}, [4, 5])
        push.result(timeout=30)  # the receiver said no: the push ends, having sent no body
    assert _sends() == 0 and sender.stats.sent == 0, "a refused transfer's body must not be posted"
    assert checksum(*cache_blocks(dst, [4, 5])) == before
    again = _move(sender, receiver, _meta("after", receiver, [4, 5]), [6, 7])
    assert again["epoch"] == payload["epoch"] and _arrived(src, dst, [6, 7], [4, 5]), "the same channel carries on"


def test_a_receive_that_cannot_get_the_turn_in_time_fails_alone(pair):
    sender, src, receiver, dst = pair
    _move(sender, receiver, _meta("warm", receiver, [0]), [1])
    holder = _meta("holder", receiver, [2, 3], deadline_s=3)  # its sender freezes: it holds the turn
    quick = _meta("quick", receiver, [4, 5], deadline_s=1)
    holder_payload, quick_payload = sender.prepare_blocks(holder, [2, 3]), sender.prepare_blocks(quick, [4, 5])
    FakeNcclPair.frozen_senders = True
    sends_before = _sends()
    with ThreadPoolExecutor(4) as pool:
        held = pool.submit(receiver.pull_blocks, holder, holder_payload, [2, 3])
        pool.submit(sender.push, holder, None, None, holder_payload)
        while _sends() == sends_before:  # the holder has the turn and its body is posted
            time.sleep(0.01)
        pushed = pool.submit(sender.push, quick, None, None, quick_payload)
        with pytest.raises(TransferError) as info:
            receiver.pull_blocks(quick, quick_payload, [4, 5])
        assert info.value.reason == "timeout"
        pushed.result(timeout=10)  # answered no: the push ends without sending
        assert _sends() == sends_before + 1, "the transfer refused at the turn must post no body"
        with pytest.raises(TransferError):
            held.result(timeout=10)


def test_a_sender_that_froze_mid_body_fails_the_receive_by_its_deadline_and_the_pair_moves_on(pair):
    sender, src, receiver, dst = pair
    _move(sender, receiver, _meta("warm", receiver, [0]), [1])
    frozen = _meta("frozen", receiver, [6, 7], deadline_s=1.5)
    payload = sender.prepare_blocks(frozen, [8, 9])
    FakeNcclPair.frozen_senders = True
    before = checksum(*cache_blocks(dst, [6, 7]))
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        push = pool.submit(sender.push, frozen, None, None, payload)
        with pytest.raises(TransferError) as info:
            receiver.pull_blocks(frozen, payload, [6, 7])
        with pytest.raises(TransferError):
            push.result(timeout=10)
    assert info.value.reason == "timeout" and time.monotonic() - t0 < 5
    assert all(w.aborted for w in FakeNcclPair.wires.values()), "a receive given up aborts the communicator"
    assert checksum(*cache_blocks(dst, [6, 7])) == before, "no byte may land after the receive gave up"
    FakeNcclPair.frozen_senders = False
    after = _move(sender, receiver, _meta("after", receiver, [10, 11]), [12, 13])
    assert after["epoch"] > payload["epoch"] and _arrived(src, dst, [12, 13], [10, 11])


def test_a_cpu_cache_takes_no_nccl_pair_and_an_unknown_kind_is_refused():
    with pytest.raises(TransferError, match="CUDA"):
        nccl_channel.NcclPair(None, 0, 1.0, torch.device("cpu"))
    with pytest.raises(ValueError, match="gloo"):
        CollectiveBackend(channel="ucx")
    if not torch.cuda.is_available():
        assert default_channel() == "gloo" and CollectiveBackend().paged, "a CPU worker moves blocks over gloo"


def test_nccl_joins_caches_on_two_gpus_and_gloo_every_other_pair():
    gpu_a, gpu_b = "GPU-1b2c", "GPU-7f00"
    assert channel_kind("nccl", gpu_a, gpu_b) == "nccl"
    assert channel_kind("nccl", gpu_a, gpu_a) == "gloo", "NCCL takes no two ranks of a communicator on one device"
    assert channel_kind("nccl", "cpu", gpu_b) == channel_kind("nccl", gpu_a, "cpu") == "gloo"
    assert channel_kind("gloo", gpu_a, gpu_b) == "gloo", "a backend without NCCL never builds it"


def test_a_backend_preferring_nccl_whose_peer_shares_its_device_moves_blocks_over_gloo():
    with paged_pair(lambda: CollectiveBackend(op_timeout_s=20, channel="nccl"), LAYOUT, SRC_BLOCKS, DST_BLOCKS) as pair:
        sender, src, receiver, dst = pair
        _move(sender, receiver, _meta("same-device", receiver, [1, 2]), [3, 4])
        assert _arrived(src, dst, [3, 4], [1, 2])
        assert not any(c.on_device for c in receiver._in.channels.values()), "one device: a gloo channel"
