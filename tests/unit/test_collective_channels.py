"""The collective backend's channel of one sender-receiver pair under failures of single
transfers: a transfer that fails for its own reasons (its header refused, its deadline
passed before it sent, the receiver abandoning it before its push posted) fails alone and
the other transfers of the pair arrive intact on the same channel; tags stay valid gloo
tags however long a pair lives, and pushes keep working across the tag limit, a transfer
prepared before it included; ``abandon`` never waits for a channel build, and stops a
push whose sends are posted at once (by closing the channel), not at its deadline; a
push that expired before its channel was built leaves the epoch to the others, and the
next build learns from the receiver's store whether the receiver gave that epoch up, or
a build already under way does, once the receiver says so (it never holds the pair past
that); a receive whose channel came only past its deadline leaves the channel whole.

Real gloo channels between two backends in one process, except for the builds that
``abandon`` must not wait for and that a receiver left: those are fakes that block on
an event.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.wire.messages import KVLayout
from kv_transfer import collective, collective_channels
from kv_transfer.base import TransferError, TransferMeta
from kv_transfer.collective import CollectiveBackend
from kv_transfer.peer import checksum
from tests.helpers import cache_blocks, paged_pair

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
SRC_BLOCKS, DST_BLOCKS = 16, 32
GLOO_TAG_LIMIT = 2**31  # torch binds a gloo tag as a C int


@pytest.fixture
def pair():
    """A fresh (sender, its cache, receiver, its cache) per test: some break channels."""
    with paged_pair(lambda: CollectiveBackend(op_timeout_s=20), LAYOUT, SRC_BLOCKS, DST_BLOCKS) as pair:
        yield pair


def _meta(tid: str, receiver: CollectiveBackend, dst_ids: list[int], deadline_s: float = 30) -> TransferMeta:
    return TransferMeta(tid, tid, LAYOUT, len(dst_ids), len(dst_ids) * LAYOUT.block_size,
                        dst_endpoint=receiver.endpoint, deadline=time.time() + deadline_s, dst_blocks=tuple(dst_ids))


def _arrived(src, dst, src_ids, dst_ids) -> bool:
    return checksum(*cache_blocks(dst, dst_ids)) == checksum(*cache_blocks(src, src_ids))


def _tags(payload: dict, meta: TransferMeta, cache) -> range:
    """The tags a paged transfer's messages go under: its header's, then its body's."""
    plan = collective.BlockPlan(list(payload["blocks"]), list(meta.dst_blocks), cache[0])
    return range(payload["tag"], payload["tag"] + 1 + plan.num_messages)


def _move(sender, receiver, meta: TransferMeta, src_ids: list[int]) -> dict:
    """One whole transfer of ``src_ids`` into ``meta.dst_blocks``; its payload."""
    payload = sender.prepare_blocks(meta, src_ids)
    with ThreadPoolExecutor(1) as pool:
        pull = pool.submit(receiver.pull_blocks, meta, payload, list(meta.dst_blocks))
        sender.push(meta, None, None, payload)
        pull.result(timeout=30)
    return payload


def _two(sender, receiver, other: str, **kwargs) -> tuple:
    """(meta, payload) of a good transfer (blocks 3, 4 into 0, 1) and of another one
    (5, 6 into 10, 11), both prepared on the pair's channel."""
    good = _meta("good", receiver, [0, 1])
    bad = _meta(other, receiver, [10, 11], **kwargs)
    return (good, sender.prepare_blocks(good, [3, 4])), (bad, sender.prepare_blocks(bad, [5, 6]))


def test_a_transfer_whose_header_is_refused_fails_alone(pair):
    sender, src, receiver, dst = pair
    (good, good_payload), (bad, bad_payload) = _two(sender, receiver, "bad")
    before = checksum(*cache_blocks(dst, [10, 11]))
    with ThreadPoolExecutor(3) as pool:
        good_pull = pool.submit(receiver.pull_blocks, good, good_payload, [0, 1])  # in flight meanwhile
        bad_push = pool.submit(sender.push, bad, None, None, bad_payload)
        with pytest.raises(TransferError, match="header"):
            # Told of other sender blocks than the sender sends: its header differs.
            receiver.pull_blocks(bad, {**bad_payload, "blocks": (7, 8)}, [10, 11])
        bad_push.result(timeout=30)  # the receiver drained its messages: the send ends
        sender.push(good, None, None, good_payload)
        good_pull.result(timeout=30)
    assert _arrived(src, dst, [3, 4], [0, 1]), "the transfer in flight beside the refused one must arrive intact"
    assert checksum(*cache_blocks(dst, [10, 11])) == before, "a refused transfer must not write its blocks"
    assert sender.num_channels == 1 and receiver.num_channels == 1, "the pair's channel stays open"


def test_a_push_past_its_deadline_fails_alone(pair):
    sender, src, receiver, dst = pair
    (good, good_payload), (late, late_payload) = _two(sender, receiver, "late", deadline_s=-1)
    with ThreadPoolExecutor(1) as pool:
        good_pull = pool.submit(receiver.pull_blocks, good, good_payload, [0, 1])
        with pytest.raises(TransferError) as info:
            sender.push(late, None, None, late_payload)
        assert info.value.reason == "timeout", f"a late push fails with its deadline, not {info.value.reason}"
        sender.push(good, None, None, good_payload)
        good_pull.result(timeout=30)
    assert _arrived(src, dst, [3, 4], [0, 1]), "the transfer beside the late one must arrive intact"


def test_a_transfer_abandoned_before_its_push_posted_fails_alone(pair):
    sender, src, receiver, dst = pair
    (good, good_payload), (refused, refused_payload) = _two(sender, receiver, "refused")
    with ThreadPoolExecutor(1) as pool:
        good_pull = pool.submit(receiver.pull_blocks, good, good_payload, [0, 1])
        sender.abandon(refused, refused_payload)  # the receiver answered before the push began
        with pytest.raises(TransferError) as info:
            sender.push(refused, None, None, refused_payload)
        assert info.value.reason == "abandoned"
        sender.push(good, None, None, good_payload)
        good_pull.result(timeout=30)
    assert _arrived(src, dst, [3, 4], [0, 1]), "the transfer beside the abandoned one must arrive intact"
    sender.release(refused, refused_payload)
    sender.release(good, good_payload)


def test_abandon_after_the_push_posted_stops_it_at_once(pair, monkeypatch):
    sender, src, receiver, dst = pair
    _move(sender, receiver, _meta("warm", receiver, [0]), [1])  # the pair's channel is built
    refused = _meta("refused", receiver, [4, 5])  # the receiver will never receive it
    payload = sender.prepare_blocks(refused, [6, 7])
    sending = threading.Event()
    exchange = collective_channels.Channel.exchange

    def spied(channel, op, tensors, first_tag, timeout_s):
        if op == "send" and first_tag == payload["tag"]:
            sending.set()
        return exchange(channel, op, tensors, first_tag, timeout_s)

    monkeypatch.setattr(collective_channels.Channel, "exchange", spied)
    with ThreadPoolExecutor(1) as pool:
        push = pool.submit(sender.push, refused, None, None, payload)
        assert sending.wait(10), "the push never came to send"
        t0 = time.monotonic()
        sender.abandon(refused, payload)
        with pytest.raises(TransferError):
            push.result(timeout=30)
    waited = time.monotonic() - t0
    assert waited < 5, f"the abandoned push went on for {waited:.1f} s (its op timeout is 20 s, its deadline 30 s)"
    after_payload = _move(sender, receiver, _meta("after", receiver, [8, 9]), [10, 11])
    assert after_payload["epoch"] > payload["epoch"], "a channel closed under a posted send is not used again"
    assert _arrived(src, dst, [10, 11], [8, 9])


def test_pushes_keep_working_across_the_tag_limit(pair):
    sender, src, receiver, dst = pair
    warm = _meta("warm", receiver, [0])
    sender.release(warm, _move(sender, receiver, warm, [1]))  # the pair's channel is built
    out = sender._outgoing(receiver.endpoint)
    out.next_tag = GLOO_TAG_LIMIT - 12  # as after some 2**31 tags' worth of transfers
    jobs = [(_meta(f"wrap-{i}", receiver, [2 * i, 2 * i + 1]), [i, i + 8]) for i in range(1, 6)]
    payloads = [sender.prepare_blocks(meta, src_ids) for meta, src_ids in jobs]
    assert payloads[0]["epoch"] < payloads[-1]["epoch"], "passing the tag limit moves the pair to a new epoch"
    for (meta, _), payload in zip(jobs, payloads):
        tags = _tags(payload, meta, dst)
        assert 0 <= tags.start and tags.stop <= GLOO_TAG_LIMIT, f"tags {tags} are not all valid gloo tags"
        assert collective_channels.CLOSE_TAG not in tags, "the tag that closes a channel is no transfer's"
    with ThreadPoolExecutor(5) as pool:
        # Those of the new epoch first: a transfer prepared before the wrap still arrives.
        order = sorted(zip(jobs, payloads), key=lambda j: -j[1]["epoch"])
        pulls = [pool.submit(receiver.pull_blocks, meta, p, meta.dst_blocks) for (meta, _), p in order]
        for (meta, _), p in order:
            sender.push(meta, None, None, p)
        for f in pulls:
            f.result(timeout=30)
    wrong = [meta.transfer_id for meta, s in jobs if not _arrived(src, dst, s, list(meta.dst_blocks))]
    assert not wrong, f"transfers {wrong} did not arrive intact across the tag limit"
    for (meta, _), p in zip(jobs, payloads):
        sender.release(meta, p)
    assert sender.num_channels == 1, "the old epoch's channel closes once its last transfer is released"


class _FreshStore:
    """A receiver's rendezvous store with nothing given up, on a CPU."""

    def check(self, keys) -> bool:
        return False

    def get(self, key: str) -> bytes:
        assert key == collective_channels.DEVICE_KEY, key
        return b"cpu"

    def set(self, key: str, value) -> None:
        pass


class _BlockedBuild:
    """A channel build that holds on until the test lets it finish (or 5 s pass)."""

    started: threading.Event
    release: threading.Event
    building = False
    closed = 0

    @classmethod
    def reset(cls) -> type:
        cls.started, cls.release, cls.building, cls.closed = threading.Event(), threading.Event(), False, 0
        return cls

    def __init__(self, store, prefix, rank, timeout_s) -> None:
        type(self).building = True
        type(self).started.set()
        type(self).release.wait(5)
        type(self).building = False
        self.peer, self.closed = 1 - rank, False

    def close(self) -> None:
        type(self).closed += 1


@pytest.fixture
def blocked_build(monkeypatch):
    """A packed sender whose channel builds block (``_BlockedBuild``), and a way to make
    the metas, K and V of its transfers."""
    monkeypatch.setattr(collective, "store_client", lambda host, port, timeout_s: _FreshStore())
    monkeypatch.setattr(collective_channels, "Channel", _BlockedBuild.reset())
    sender = CollectiveBackend(op_timeout_s=20)
    sender.paged = False  # packed KV: no cache to attach
    k = v = collective.torch.zeros(LAYOUT.packed_shape(1))

    def meta(tid: str, deadline_s: float = 30) -> TransferMeta:
        return TransferMeta(tid, tid, LAYOUT, 1, LAYOUT.block_size, dst_endpoint="127.0.0.1:1",
                            deadline=time.time() + deadline_s)

    return sender, meta, k, v


def test_abandon_never_waits_for_a_channel_build(blocked_build):
    sender, make_meta, k, v = blocked_build
    meta = make_meta("t")
    payload = sender.prepare(meta, k, v)
    with ThreadPoolExecutor(1) as pool:
        push = pool.submit(sender.push, meta, k, v, payload)
        assert _BlockedBuild.started.wait(10), "the push never began building its channel"
        sender.abandon(meta, payload)
        still_building = _BlockedBuild.building
        _BlockedBuild.release.set()
        with pytest.raises(TransferError) as info:
            push.result(timeout=30)
    assert still_building, "abandon waited for the channel build to end (it runs on an event loop)"
    assert info.value.reason == "abandoned", "the push abandoned during its build must not send"
    assert _BlockedBuild.closed == 0, "a transfer abandoned before it sent leaves the channel to the others"


def test_a_push_on_an_epoch_whose_build_the_receiver_gave_up_fails_at_once(pair):
    sender, src, receiver, dst = pair
    early = _meta("early", receiver, [0], deadline_s=0.5)
    early_payload = sender.prepare_blocks(early, [1])
    with pytest.raises(TransferError):
        receiver.pull_blocks(early, early_payload, [0])  # builds, and gives up: no sender came
    with pytest.raises(TransferError) as info:
        sender.push(early, None, None, early_payload)  # too late to build: fails alone, epoch kept
    assert info.value.reason == "timeout"
    late = _meta("late-on-dead-epoch", receiver, [1])
    late_payload = sender.prepare_blocks(late, [2])
    assert late_payload["epoch"] == early_payload["epoch"]
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        sender.push(late, None, None, late_payload)
    assert info.value.reason == "channel_closed" and time.monotonic() - t0 < 5, (
        f"the push took {time.monotonic() - t0:.1f} s to fail ({info.value.reason}) on a build the receiver gave up")
    after_payload = _move(sender, receiver, _meta("after", receiver, [2, 3]), [4, 5])
    assert after_payload["epoch"] > late_payload["epoch"], "the next transfer goes on a new epoch"
    assert _arrived(src, dst, [4, 5], [2, 3])


def test_a_push_waiting_for_another_transfers_build_fails_by_its_own_deadline(blocked_build):
    sender, make_meta, k, v = blocked_build
    slow, quick = make_meta("slow-build"), make_meta("quick", deadline_s=0.5)
    slow_payload, quick_payload = sender.prepare(slow, k, v), sender.prepare(quick, k, v)
    with ThreadPoolExecutor(1) as pool:
        build = pool.submit(sender.push, slow, k, v, slow_payload)
        assert _BlockedBuild.started.wait(10), "the first push never began building its channel"
        with pytest.raises(TransferError) as info:
            sender.push(quick, k, v, quick_payload)  # waits for the same build
        still_building = _BlockedBuild.building
        _BlockedBuild.release.set()
        build.exception(timeout=30)
    assert still_building, "the push waited for the other transfer's build past its own deadline"
    assert info.value.reason == "timeout"


def test_a_transfer_the_receiver_refuses_unread_fails_alone(pair):
    """A receiver that will not read a transfer at all (its reservation ended, a check
    failed first) refuses it: the pushed bytes are taken off the channel, the push ends,
    and the pair's other transfers go on over the same channel."""
    sender, src, receiver, dst = pair
    (good, good_payload), (bad, bad_payload) = _two(sender, receiver, "refused")
    before = checksum(*cache_blocks(dst, [10, 11]))
    with ThreadPoolExecutor(3) as pool:
        good_pull = pool.submit(receiver.pull_blocks, good, good_payload, [0, 1])
        bad_push = pool.submit(sender.push, bad, None, None, bad_payload)
        receiver.refuse(bad, bad_payload)
        bad_push.result(timeout=30)  # it ends: its messages were received into scratch memory
        sender.push(good, None, None, good_payload)
        good_pull.result(timeout=30)
    assert _arrived(src, dst, [3, 4], [0, 1]), "the other transfer must arrive intact"
    assert checksum(*cache_blocks(dst, [10, 11])) == before, "no byte of the refused one may land"
    _move(sender, receiver, _meta("after", receiver, [20, 21]), [7, 8])  # the channel is whole
    assert _arrived(src, dst, [7, 8], [20, 21])


class _HeldMarks:
    """A receiver's rendezvous store whose "given up" marks land only once ``may_land``
    is set: the receiver's thread, descheduled between its failed build and the mark.
    ``left`` gets each given-up channel's prefix as the receiver comes to mark it."""

    def __init__(self, inner, may_land: threading.Event, left: set) -> None:
        self.inner, self.may_land, self.left = inner, may_land, left

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def set(self, key: str, value) -> None:
        if key.startswith("given-up/"):
            self.left.add(key.removeprefix("given-up/"))
            self.may_land.wait(30)
        self.inner.set(key, value)


def test_a_sender_building_as_the_receiver_gives_up_fails_fast_and_frees_the_pair(pair, monkeypatch):
    """The receiver gives up building an epoch's channel (its transfer's deadline), and the
    sender starts building the same epoch before the receiver's mark says so. gloo's build
    against a rendezvous its peer left can outlast its timeout five-fold (measured), under
    the pair's build lock; here it hangs until the test ends. The push must fail
    channel_closed once the mark lands, and the pair's next transfer arrive."""
    sender, src, receiver, dst = pair
    left, hanging, may_land, end = set(), threading.Event(), threading.Event(), threading.Event()
    gloo = collective_channels.Channel

    class GlooAfterAGiveUp(gloo):
        def __init__(self, store, prefix, rank, timeout_s) -> None:
            if rank == 0 and prefix in left:
                hanging.set()
                end.wait(10)
                raise RuntimeError("Gloo connectFullMesh failed: Connect timeout")
            super().__init__(store, prefix, rank, timeout_s)

    monkeypatch.setattr(collective_channels, "Channel", GlooAfterAGiveUp)
    receiver.endpoint  # noqa: B018  (its store starts on first use)
    receiver._store = _HeldMarks(receiver._store, may_land, left)
    given_up = _meta("given-up", receiver, [0], deadline_s=0.5)
    given_up_payload = sender.prepare_blocks(given_up, [1])
    recovery = _meta("recovery", receiver, [1], deadline_s=10)
    try:
        with ThreadPoolExecutor(2) as pool:
            gave_up = pool.submit(receiver.pull_blocks, given_up, given_up_payload, [0])  # nobody pushes
            while not left:  # its build fails at its deadline; its mark waits
                assert not gave_up.done(), gave_up.exception()
                time.sleep(0.01)
            payload = sender.prepare_blocks(recovery, [2])
            assert payload["epoch"] == given_up_payload["epoch"], "prepared on the epoch the receiver left"
            push = pool.submit(sender.push, recovery, None, None, payload)
            assert hanging.wait(10), "the sender never began building the left epoch's channel"
            may_land.set()
            t0 = time.monotonic()
            with pytest.raises(TransferError) as info:
                push.result(timeout=30)
            waited = time.monotonic() - t0
            with pytest.raises(TransferError):
                gave_up.result(timeout=30)
    finally:
        end.set()
    assert info.value.reason == "channel_closed" and waited < 2, (
        f"the push failed {info.value.reason} {waited:.1f} s after the receiver's mark: {info.value}")
    after = _move(sender, receiver, _meta("after", receiver, [2, 3]), [4, 5])
    assert after["epoch"] > payload["epoch"] and _arrived(src, dst, [4, 5], [2, 3])


def test_a_receive_whose_channel_came_after_its_deadline_posts_nothing_and_keeps_the_channel(pair, monkeypatch):
    """A receiver's build can end past its transfer's deadline (a sender joined at the last
    moment, for another transfer). That receive must fail without posting anything on the
    channel (a receive posted past the deadline must close the channel, failing the other
    transfer), so the pair's other transfers go on over it."""
    sender, src, receiver, dst = pair
    _move(sender, receiver, _meta("warm", receiver, [0]), [1])  # the pair's channel is built
    late = _meta("late", receiver, [4], deadline_s=0.5)
    late_payload = sender.prepare_blocks(late, [6])
    built = receiver._recv_channel

    def built_late(key, meta, live):
        channel = built(key, meta, live)
        while meta.time_left() > 0:  # the build ended as the deadline passed
            time.sleep(0.01)
        return channel

    monkeypatch.setattr(receiver, "_recv_channel", built_late)
    with pytest.raises(TransferError) as info:
        receiver.pull_blocks(late, late_payload, [4])
    assert info.value.reason == "timeout"
    monkeypatch.setattr(receiver, "_recv_channel", built)
    other = _meta("other", receiver, [8, 9])
    assert _move(sender, receiver, other, [10, 11])["epoch"] == late_payload["epoch"], "the same channel"
    assert _arrived(src, dst, [10, 11], [8, 9]), "the pair's next transfer arrives over the same channel"
    assert receiver.num_channels == 1
