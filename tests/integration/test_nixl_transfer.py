"""NIXL backend between Ray actors: what the conformance suite cannot ask of every backend.

Sizes that disagree with the layout are refused before a byte is read; a sender
that died fails the read within seconds; a sender that is frozen (SIGSTOP) fails
it at its deadline, since NIXL itself never gives up on one; the sender hears of
each finished read; and after every failure the receiver still serves the next
transfer and holds no staging buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time

import pytest
import ray

from kv_transfer import KVLayout, TransferError, TransferMeta
from kv_transfer.config import TransferConfig
from kv_transfer.nixl import unavailable_reason
from kv_transfer.peer import TransferPeer
from tests.helpers import PATIENCE_S, wait_for

NIXL_MISSING = unavailable_reason()
pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl unavailable: {NIXL_MISSING}")

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32")


class NixlPeer(TransferPeer):
    """A transfer endpoint that also answers what these tests look at."""

    def reads_confirmed(self) -> int:
        return self.backend.reads_confirmed()

    def held(self) -> tuple[int, int]:
        """(regions still registered as sender, staging buffers lent as receiver)."""
        return self.backend.num_held, self.backend.staging_in_use


def _peer():
    actor = ray.remote(NixlPeer).options(num_cpus=0, max_concurrency=16)
    return actor.remote(TransferConfig(backend="nixl"))


@pytest.fixture(scope="module")
def receiver(ray_cluster):
    peer = _peer()
    yield peer
    ray.kill(peer)


@pytest.fixture
def sender(ray_cluster):
    peer = _peer()
    pid = ray.get(peer.pid.remote())
    yield peer, pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)  # a test that failed mid-freeze must not leave it stopped
    ray.kill(peer)


def _meta(tid: str, num_blocks: int = 3, deadline_s: float = 30.0) -> TransferMeta:
    return TransferMeta(
        transfer_id=tid, request_id=tid, layout=LAYOUT, num_blocks=num_blocks,
        num_tokens=num_blocks * LAYOUT.block_size, deadline=time.time() + deadline_s,
    )


def _transfer(sender, receiver, meta: TransferMeta, seed: int) -> tuple[str, str]:
    payload, sent = ray.get(sender.prepare.remote(meta, seed))
    got, _ = ray.get(receiver.pull.remote(meta, payload), timeout=60)
    ray.get(sender.release.remote(meta))
    return sent, got


def _failure(ref, timeout: float = 60) -> tuple[TransferError, float]:
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        ray.get(ref, timeout=timeout)
    return info.value, time.monotonic() - t0


def _assert_receiver_goes_on(receiver, tid: str) -> None:
    fresh = _peer()
    try:
        sent, got = _transfer(fresh, receiver, _meta(tid), seed=99)
        assert got == sent, "after a failed transfer the next one from a live sender must arrive intact"
    finally:
        ray.kill(fresh)
    assert ray.get(receiver.held.remote())[1] == 0, "every staging buffer must be back in the pool"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _known_to_the_receiver(peer, receiver, connected: bool, tid: str, seed: int) -> None:
    """With ``connected``, one transfer first, so that the receiver has met the sender."""
    if connected:
        sent, got = _transfer(peer, receiver, _meta(tid), seed=seed)
        assert got == sent


def test_sizes_that_disagree_with_the_layout_are_refused_before_any_read(sender, receiver):
    peer, _ = sender
    before = ray.get(peer.reads_confirmed.remote())
    # The sender offers 2 blocks; the receiver was told 3.
    payload, _ = ray.get(peer.prepare.remote(_meta("short", num_blocks=2), seed=1))
    error, _ = _failure(receiver.pull.remote(_meta("short", num_blocks=3), payload))
    assert "offers K+V of" in str(error), f"expected a size refusal, got {error}"
    # Sizes that claim 3 blocks over descriptors of 2: the descriptors are checked too.
    forged = dataclasses.replace(payload, nbytes=(LAYOUT.nbytes(3) // 2,) * 2)
    error, _ = _failure(receiver.pull.remote(_meta("short", num_blocks=3), forged))
    assert "disagree with sizes" in str(error), f"expected a descriptor refusal, got {error}"
    time.sleep(0.5)  # a READ's notification would have reached the sender by now
    assert ray.get(peer.reads_confirmed.remote()) == before, "a refused transfer must not read a byte"
    assert ray.get(receiver.stats.remote())["failures"].get("layout", 0) >= 2, "refusals count as 'layout'"
    ray.get(peer.release.remote(_meta("short", num_blocks=2)))
    assert ray.get(peer.held.remote())[0] == 0, "release must deregister the sender's regions"


@pytest.mark.parametrize("connected", [False, True], ids=["unknown-sender", "connected-sender"])
def test_a_sender_killed_before_the_read_fails_it_within_seconds(sender, receiver, connected):
    peer, pid = sender
    _known_to_the_receiver(peer, receiver, connected, f"before-kill-{connected}", seed=2)
    payload, _ = ray.get(peer.prepare.remote(_meta(f"killed-{connected}"), seed=3))
    ray.kill(peer)
    wait_for(lambda: _gone(pid), PATIENCE_S, f"actor process {pid} to exit after ray.kill")
    error, elapsed = _failure(receiver.pull.remote(_meta(f"killed-{connected}"), payload))
    assert error.reason == "peer_lost", f"expected reason 'peer_lost', got {error.reason!r}: {error}"
    assert elapsed < 5.0, f"a dead sender must fail the read at once, not after {elapsed:.1f}s"
    _assert_receiver_goes_on(receiver, f"after-kill-{connected}")


@pytest.mark.parametrize("connected", [False, True], ids=["unknown-sender", "connected-sender"])
def test_a_frozen_sender_fails_the_read_at_its_deadline(sender, receiver, connected):
    peer, pid = sender
    _known_to_the_receiver(peer, receiver, connected, f"before-freeze-{connected}", seed=4)
    meta = _meta(f"frozen-{connected}", deadline_s=2.0)
    payload, _ = ray.get(peer.prepare.remote(meta, seed=5))
    os.kill(pid, signal.SIGSTOP)
    try:
        error, elapsed = _failure(receiver.pull.remote(meta, payload))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert error.reason == "timeout", f"expected reason 'timeout', got {error.reason!r}: {error}"
    assert elapsed < 4.0, f"the read must end at its deadline (2 s), not after {elapsed:.1f}s"
    ray.get(peer.release.remote(meta))
    # The abandoned read's thread releases its handle and staging just after.
    wait_for(lambda: ray.get(receiver.held.remote())[1] == 0, PATIENCE_S,
             "the abandoned read to give its staging buffer back")
    sent, got = _transfer(peer, receiver, _meta(f"thawed-{connected}"), seed=6)
    assert got == sent, "a thawed sender must serve the next transfer intact"
    _assert_receiver_goes_on(receiver, f"after-freeze-{connected}")


def test_the_sender_hears_of_each_finished_read_and_release_frees_its_regions(sender, receiver):
    peer, _ = sender
    before = ray.get(peer.reads_confirmed.remote())
    for i in range(3):
        sent, got = _transfer(peer, receiver, _meta(f"heard-{i}", num_blocks=1 + i), seed=10 + i)
        assert got == sent
    wait_for(lambda: ray.get(peer.reads_confirmed.remote()) >= before + 3, PATIENCE_S,
             "the sender to hear of the 3 finished reads")
    assert ray.get(peer.reads_confirmed.remote()) == before + 3, "one notification per finished read"
    assert ray.get(peer.held.remote()) == (0, 0), "released transfers leave no registered region"
    assert ray.get(receiver.held.remote())[1] == 0, "recycled staging buffers are back in the pool"
