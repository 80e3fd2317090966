"""Conformance suite: every transfer backend the machine can run, between two processes.

The same checks run against each backend: bytes arrive intact (float32 and
bfloat16, compared by sha256), concurrent transfers from two senders to one receiver do
not mix, a transfer past its deadline fails with reason "timeout" and is counted, and a
released transfer leaves nothing held. The collective backend's pairwise channels are
checked further: a layout that does not match is refused before any byte moves (and
the pair's channel stays), a receiver that gives up does not stall the pair, and a
sender that dies mid-stream breaks only its own channel. The same channel between
actors on a GPU (KV staged through host memory) is checked in
``tests/gpu/test_gpu_transfer.py``; NIXL's own failure modes (refused sizes, dead
and frozen senders) are in ``test_nixl_transfer.py``.
"""

from __future__ import annotations

import time

import pytest
import ray

from kv_transfer import KVLayout, TransferError, TransferMeta
from kv_transfer.config import TransferConfig
from kv_transfer.nixl import unavailable_reason
from kv_transfer.peer import TransferPeer, checksum, make_kv
from tests.helpers import wait_for

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32")

NIXL_MISSING = unavailable_reason()
BACKENDS = [
    "object_store",
    "collective",  # gloo, as the actors see no GPU
    pytest.param("nixl", marks=pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl unavailable: {NIXL_MISSING}")),
]


@pytest.fixture(scope="module", params=BACKENDS)
def peers(request, ray_cluster):
    """Two senders and one receiver."""
    actor = ray.remote(TransferPeer).options(num_cpus=0, max_concurrency=64)
    peers = [actor.remote(TransferConfig(backend=request.param)) for _ in range(3)]
    yield peers
    for p in peers:
        ray.kill(p)


def _meta(tid, receiver, num_blocks=3, layout=LAYOUT, deadline_s=30.0):
    return TransferMeta(
        transfer_id=tid, request_id=tid, layout=layout, num_blocks=num_blocks,
        num_tokens=num_blocks * layout.block_size,
        dst_endpoint=ray.get(receiver.endpoint.remote()) if receiver is not None else "",
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
    sent, got = _transfer(peers[0], peers[2], _meta(f"intact-{dtype}", peers[2], layout=layout), seed=1)
    assert got == sent, "received KV differs from what was sent"


def test_concurrent_transfers_from_two_senders_do_not_mix(peers):
    metas, expected, pulls = [], [], []
    for i in range(8):
        src = i % 2
        meta = _meta(f"mix-{i}", peers[2], num_blocks=1 + i)
        payload, s = ray.get(peers[src].prepare.remote(meta, seed=100 + i))
        metas.append((src, meta))
        expected.append(s)
        pulls.append(peers[2].pull.remote(meta, payload))
    pushes = [peers[src].push.remote(meta) for src, meta in metas]
    ray.get(pushes, timeout=60)
    got = [r[0] for r in ray.get(pulls, timeout=60)]
    assert got == expected, "each transfer must deliver its own bytes"
    ray.get([peers[src].release.remote(meta) for src, meta in metas])


def assert_a_late_transfer_fails_and_the_next_arrives(sender, receiver) -> None:
    """A transfer past its deadline fails on both sides; the pair's next one arrives intact."""
    meta = _meta("late", receiver, deadline_s=-1.0)
    payload, _ = ray.get(sender.prepare.remote(meta, 3))
    with pytest.raises(TransferError, match="deadline|timed out"):
        ray.get(receiver.pull.remote(meta, payload), timeout=30)
    # The sender still pushes, as a prefill worker does: a late transfer must not
    # break the pair for the transfers after it.
    with pytest.raises(TransferError, match="deadline"):
        ray.get(sender.push.remote(meta), timeout=30)
    ray.get(sender.release.remote(meta))
    sent, got = _transfer(sender, receiver, _meta("after-late", receiver), seed=4)
    assert got == sent, "the transfer after a late one must arrive intact"


def test_transfer_past_its_deadline_fails_and_is_counted(peers):
    before = ray.get(peers[2].stats.remote())["failures"].get("timeout", 0)
    assert_a_late_transfer_fails_and_the_next_arrives(peers[0], peers[2])
    after = ray.get(peers[2].stats.remote())["failures"].get("timeout", 0)
    assert after == before + 1, "a timed-out transfer is counted once by the receiver"


def test_inprocess_backend_round_trip_and_release():
    from kv_transfer.inprocess import InProcessBackend

    backend = InProcessBackend()
    meta = _meta("local", None)
    k, v = make_kv(LAYOUT, 3, seed=4)
    payload = backend.prepare(meta, k, v)
    k2, v2 = backend.pull(meta, payload)
    assert checksum(k2, v2) == checksum(k, v)
    backend.release(meta, payload)
    assert backend.num_held == 0, "release must drop the sender's copy"
    with pytest.raises(TransferError, match="no data"):
        backend.pull(meta, payload)
    with pytest.raises(TransferError, match="deadline"):
        backend.pull(_meta("late", None, deadline_s=-1), payload)


# -- the collective backend's pairwise channels ---------------------------------------


@pytest.fixture
def channel_peers(ray_cluster):
    """Fresh collective peers per test: these tests break channels on purpose."""
    actor = ray.remote(TransferPeer).options(num_cpus=0, max_concurrency=64)
    peers = [actor.remote(TransferConfig(backend="collective", op_timeout_s=20)) for _ in range(3)]
    yield peers
    for p in peers:
        ray.kill(p)


def test_a_transfer_that_is_not_the_announced_one_is_refused_before_bytes_land(channel_peers):
    sender, receiver = channel_peers[0], channel_peers[2]
    meta = _meta("announced", receiver, num_blocks=3)
    payload, _ = ray.get(sender.prepare.remote(meta, seed=5))
    # The receiver expects four blocks where the sender packed three: the header differs.
    expected = TransferMeta(**{**meta.__dict__, "num_blocks": 4})
    pull = receiver.pull.remote(expected, payload)
    # The receiver drains the refused transfer's messages into scratch memory: the send
    # ends, the channel stays whole for the pair's other transfers.
    ray.get(sender.push.remote(meta), timeout=30)
    with pytest.raises(TransferError, match="header"):
        ray.get(pull, timeout=30)
    assert ray.get(receiver.stats.remote())["bytes_received"] == 0, "no byte may land"
    ray.get(sender.release.remote(meta))
    sent, got = _transfer(sender, receiver, _meta("after-refusal", receiver), seed=6)
    assert got == sent, "a refused transfer must leave the pair working"


def test_a_receiver_that_gives_up_breaks_neither_the_pair_nor_the_process(channel_peers):
    sender, receiver = channel_peers[0], channel_peers[2]
    meta = _meta("given-up", receiver, deadline_s=1.5)
    payload, _ = ray.get(sender.prepare.remote(meta, seed=7))
    with pytest.raises(TransferError, match="deadline|timed out"):
        ray.get(receiver.pull.remote(meta, payload), timeout=30)  # nobody pushes
    # The sender pushes after the receiver gave up: its send must fail, not hang or land.
    with pytest.raises(TransferError):
        ray.get(sender.push.remote(meta), timeout=30)
    ray.get(sender.release.remote(meta))
    # The receiver gave up building that epoch's channel: a transfer prepared on it
    # meanwhile fails, at once ("channel_closed"; or "connect", when the sender's build
    # starts before the receiver's mark lands and gloo refuses it), never at its deadline:
    # a sender's build the receiver left must not hold the pair (it could, five times its
    # timeout, before). The next epoch's channel is whole.
    attempts = iter(range(1000))

    def recovered() -> bool:
        meta = _meta(f"recovery-{next(attempts)}", receiver)
        attempt, sent = ray.get(sender.prepare.remote(meta, seed=7))
        pull = receiver.pull.remote(meta, attempt)
        t0 = time.monotonic()
        try:
            ray.get(sender.push.remote(meta), timeout=30)
            got, _ = ray.get(pull, timeout=60)
        except TransferError as e:
            assert attempt["epoch"] == payload["epoch"], f"only the given-up epoch may fail a transfer now: {e}"
            assert time.monotonic() - t0 < 10, f"a transfer failed {time.monotonic() - t0:.0f} s late: {e}"
            return False
        finally:
            ray.get(sender.release.remote(meta))
        return got == sent

    wait_for(recovered, 60, "a transfer after the abandoned send ended", every_s=0.5)
    for i in range(3):  # the next transfers build a fresh channel and arrive intact
        sent, got = _transfer(sender, receiver, _meta(f"after-give-up-{i}", receiver), seed=8 + i)
        assert got == sent, f"transfer {i} after a receiver gave up must arrive intact"


def test_transfers_of_one_pair_match_whatever_order_they_run_in(channel_peers):
    sender, receiver = channel_peers[0], channel_peers[2]
    metas = [_meta(f"order-{i}", receiver, num_blocks=1 + i % 3) for i in range(6)]
    prepared = [ray.get(sender.prepare.remote(m, seed=20 + i)) for i, m in enumerate(metas)]
    pulls = [receiver.pull.remote(m, p) for m, (p, _) in zip(metas, prepared)]
    ray.get([sender.push.remote(m) for m in reversed(metas)], timeout=60)  # pushed last first
    got = [r[0] for r in ray.get(pulls, timeout=60)]
    assert got == [s for _, s in prepared], "each receive must get its own transfer's bytes"
    ray.get([sender.release.remote(m) for m in metas])


def test_a_dead_sender_breaks_only_its_own_channel(channel_peers):
    doomed, other, receiver = channel_peers
    for sender, seed in ((doomed, 30), (other, 31)):  # both channels built and working
        sent, got = _transfer(sender, receiver, _meta(f"warm-{seed}", receiver), seed=seed)
        assert got == sent
    meta = _meta("doomed", receiver, num_blocks=2)
    payload, _ = ray.get(doomed.prepare.remote(meta, seed=32))
    pull = receiver.pull.remote(meta, payload)  # posted; the sender dies before sending
    ray.kill(doomed)
    t0 = time.time()
    with pytest.raises(TransferError, match="channel|closed|peer"):
        ray.get(pull, timeout=30)
    assert time.time() - t0 < 15, "a dead peer must fail the receive long before its deadline"
    sent, got = _transfer(other, receiver, _meta("survivor", receiver), seed=33)
    assert got == sent, "another sender's channel must keep working after a peer died"
