"""Conformance suite: every transfer backend the machine can run, between two processes.

The same checks run against each backend: bytes arrive intact (float32 and
bfloat16), concurrent transfers from two senders to one receiver do not mix, a
transfer past its deadline fails with reason "timeout" and is counted, and a
released transfer leaves nothing held. NCCL needs a GPU per rank: its checks are in
``tests/gpu/test_nccl_transfer.py``.
"""

from __future__ import annotations

import time

import pytest
import ray

from kv_transfer import KVLayout, TransferError, TransferMeta
from kv_transfer.config import TransferConfig
from kv_transfer.peer import TransferPeer, checksum, make_kv

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32")

BACKENDS = ["object_store", "collective"]  # collective: gloo, as the actors see no GPU


@pytest.fixture(scope="module", params=BACKENDS)
def peers(request, ray_cluster):
    """Two senders and one receiver sharing one transfer group."""
    actor = ray.remote(TransferPeer).options(num_cpus=0, max_concurrency=64)
    peers = [actor.remote(TransferConfig(backend=request.param)) for _ in range(3)]
    ray.get([p.join.remote(3, rank, 0) for rank, p in enumerate(peers)], timeout=120)
    yield peers
    for p in peers:
        ray.kill(p)


def _meta(tid, src, dst, num_blocks=3, layout=LAYOUT, deadline_s=30.0):
    return TransferMeta(
        transfer_id=tid, request_id=tid, layout=layout, num_blocks=num_blocks,
        num_tokens=num_blocks * layout.block_size, src_rank=src, dst_rank=dst,
        deadline=time.time() + deadline_s,
    )


def _transfer(sender, receiver, meta, seed):
    payload, sent_sum = ray.get(sender.prepare.remote(meta, seed))
    pull = receiver.pull.remote(meta, payload)
    ray.get(sender.push.remote(meta))
    got_sum, _ = ray.get(pull, timeout=60)
    ray.get(sender.release.remote(meta))
    return sent_sum, got_sum


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_arrives_intact(peers, dtype):
    layout = KVLayout(2, 16, 2, 64, dtype)
    sent, got = _transfer(peers[0], peers[2], _meta(f"intact-{dtype}", 0, 2, layout=layout), seed=1)
    assert got == sent, "received KV differs from what was sent"


def test_concurrent_transfers_from_two_senders_do_not_mix(peers):
    metas, expected, pulls = [], [], []
    for i in range(8):
        src = i % 2
        meta = _meta(f"mix-{i}", src, 2, num_blocks=1 + i)
        payload, s = ray.get(peers[src].prepare.remote(meta, seed=100 + i))
        metas.append((src, meta))
        expected.append(s)
        pulls.append(peers[2].pull.remote(meta, payload))
    pushes = [peers[src].push.remote(meta) for src, meta in metas]
    ray.get(pushes, timeout=60)
    got = [r[0] for r in ray.get(pulls, timeout=60)]
    assert got == expected, "each transfer must deliver its own bytes"
    ray.get([peers[src].release.remote(meta) for src, meta in metas])


def test_transfer_past_its_deadline_fails_and_is_counted(peers):
    meta = _meta("late", 0, 2, deadline_s=-1.0)
    payload, _ = ray.get(peers[0].prepare.remote(meta, seed=3))
    before = ray.get(peers[2].stats.remote())["failures"].get("timeout", 0)
    with pytest.raises(TransferError, match="deadline|timed out"):
        ray.get(peers[2].pull.remote(meta, payload), timeout=30)
    # The sender still pushes, as a prefill worker does: a late transfer must not
    # leave the pair's messages out of step for the transfers after it.
    with pytest.raises(TransferError, match="deadline"):
        ray.get(peers[0].push.remote(meta), timeout=30)
    ray.get(peers[0].release.remote(meta))
    sent, got = _transfer(peers[0], peers[2], _meta("after-late", 0, 2), seed=4)
    assert got == sent, "the transfer after a late one must arrive intact"
    after = ray.get(peers[2].stats.remote())["failures"].get("timeout", 0)
    assert after == before + 1, "a timed-out transfer is counted once by the receiver"


def test_inprocess_backend_round_trip_and_release():
    from kv_transfer.inprocess import InProcessBackend

    backend = InProcessBackend()
    meta = _meta("local", -1, -1)
    k, v = make_kv(LAYOUT, 3, seed=4)
    payload = backend.prepare(meta, k, v)
    k2, v2 = backend.pull(meta, payload)
    assert checksum(k2, v2) == checksum(k, v)
    backend.release(meta, payload)
    assert backend.num_held == 0, "release must drop the sender's copy"
    with pytest.raises(TransferError, match="no data"):
        backend.pull(meta, payload)
    with pytest.raises(TransferError, match="deadline"):
        backend.pull(_meta("late", -1, -1, deadline_s=-1), payload)
