"""The worker pools' health thread against a shutdown, without Ray (its calls are faked)."""

from __future__ import annotations

import threading

import pytest
from ray.exceptions import RayActorError

import cluster.pools as pools
from cluster.config import ClusterConfig
from router.dispatch import WorkerRef


class _Ping:
    """``handle.ready.remote()``: a ref the faked ``ray.wait`` / ``ray.get`` understand."""

    def __init__(self, worker: str) -> None:
        self.worker = worker


class _Handle:
    def __init__(self, worker: str) -> None:
        self.ready = self
        self.worker = worker

    def remote(self) -> _Ping:
        return _Ping(self.worker)


@pytest.fixture
def cluster(monkeypatch):
    """A cluster of two listed decode workers; ``decode-1`` never answers a ping."""
    c = pools.TandemCluster(ClusterConfig(prefill_workers=0, decode_workers=2))
    c._pgs = {"colocated": "pg"}
    c._slots = [pools._Slot("colocated", i, "pg", i, WorkerRef(f"decode-{i}", _Handle(f"decode-{i}")), pid=10 + i)
                for i in range(2)]
    spawned: list[str] = []
    monkeypatch.setattr(c, "_spawn", lambda slot: spawned.append(slot.ref) or WorkerRef("new", _Handle("new")))
    monkeypatch.setattr(pools, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(pools.ray, "kill", lambda handle, no_restart=True: None)

    def get(ref, timeout=None):
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref.worker == "decode-1":
            raise RayActorError()
        return {"pid": 1}

    monkeypatch.setattr(pools.ray, "get", get)
    c.spawned = spawned
    return c


def test_a_dead_worker_is_replaced_in_its_bundle(cluster, monkeypatch):
    monkeypatch.setattr(pools.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    assert cluster.check_health() == ["new"]
    assert [s.ref.worker_id for s in cluster._slots] == ["decode-0", "new"]
    assert cluster._slots[1].bundle == 1


def test_a_shutdown_while_the_health_thread_pings_starts_no_replacement(cluster, monkeypatch):
    """The health thread found a worker silent just as the pools were being shut down:
    it must not start a replacement into a placement group that is gone (which failed
    with a KeyError, or would leave an actor no one kills)."""

    def wait(refs, num_returns, timeout):
        stopper = threading.Thread(target=cluster.shutdown)
        stopper.start()
        stopper.join(0.2)  # the shutdown runs while this ping is out (it may wait for the health thread)
        return [r for r in refs if r.worker != "decode-1"], []

    monkeypatch.setattr(pools.ray, "wait", wait)
    assert cluster.check_health() == []
    assert cluster.spawned == [], "a replacement was started after the shutdown"
    assert cluster._slots == [] and cluster._pgs == {}


def test_a_replacement_that_dies_before_it_is_ready_is_started_again_and_listed_later(cluster, monkeypatch):
    """A node is lost with both workers on it: each replacement goes into its worker's
    bundle, and one of them lands on the dead node before the GCS has noticed, to be
    cancelled once it does (``ActorDiedError``; Ray moves the bundle). The round must
    not fail on it (it raised, leaving the other replacement's pid unrecorded): it lists
    the one that came up and starts the dead one's again (unlisted until it answers),
    which a later round lists."""
    started = iter(["doomed", "fine", "again"])
    monkeypatch.setattr(cluster, "_spawn", lambda slot: WorkerRef(f"decode-{slot.index}", _Handle(next(started))))

    def get(ref, timeout=None):
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref.worker in ("decode-0", "decode-1", "doomed"):  # the lost node's workers, and the one placed there
            raise RayActorError()
        return {"pid": 7}

    monkeypatch.setattr(pools.ray, "get", get)
    monkeypatch.setattr(pools.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    assert cluster.check_health() == ["decode-1"]
    assert [(s.ref.handle.worker, s.pid) for s in cluster._slots] == [("again", None), ("fine", 7)]
    assert [w.worker_id for w in cluster.workers()] == ["decode-1"], "a replacement is listed once it answers"
    assert cluster.starting() == ["decode-0"]
    assert cluster.check_health() == ["decode-0"]
    assert [(s.ref.handle.worker, s.pid) for s in cluster._slots] == [("again", 7), ("fine", 7)]


def test_a_replacement_with_no_room_stays_starting_unlisted_while_the_rounds_go_on(cluster, monkeypatch):
    """A replacement whose bundle no node has room for does not answer ``ready``: each
    round waits for it at most the ping timeout and goes on, leaves it unlisted (nothing
    is placed on it) and starts no other; once it answers, a round lists it."""
    answering = {"decode-0"}
    timeouts = []

    def wait(refs, num_returns, timeout):
        timeouts.append(timeout)
        return [r for r in refs if r.worker in answering], []

    monkeypatch.setattr(pools.ray, "wait", wait)
    for _ in range(3):
        assert cluster.check_health() == []
        assert [w.worker_id for w in cluster.workers()] == ["decode-0"] and cluster.starting() == ["new"]
    assert len(cluster.spawned) == 1, "one replacement, not one a round"
    assert max(timeouts) == pools.PING_TIMEOUT_S, "a round never waits longer than a ping"
    answering.add("new")
    assert cluster.check_health() == ["new"]
    assert [w.worker_id for w in cluster.workers()] == ["decode-0", "new"] and cluster.starting() == []


class _Reader(_Handle):
    """A decode worker's handle that records ``sender_gone`` calls."""

    def __init__(self, worker: str) -> None:
        super().__init__(worker)
        self.gone: list[str] = []
        self.sender_gone = self

    def remote(self, *args):
        if args:
            self.gone.append(args[0])
            return None
        return super().remote()


def test_a_removed_prefill_worker_is_gone_for_every_decode_worker(monkeypatch):
    """Killed, its memory is gone: a decode worker holding blocks out of use for a read of
    it that could not be stopped (quarantined) gets them back now, not never."""
    c = pools.TandemCluster(ClusterConfig(prefill_workers=1, decode_workers=2))
    readers = [_Reader(f"decode-{i}") for i in range(2)]
    c._slots = [pools._Slot("prefill", 0, "pg", 0, WorkerRef("prefill-0", _Handle("prefill-0")), pid=10)] + [
        pools._Slot("decode", i, "pg", i, WorkerRef(f"decode-{i}", r), pid=11 + i) for i, r in enumerate(readers)]
    monkeypatch.setattr(pools, "drain_actor", lambda handle, timeout_s, poll_s: False)  # a read still in flight
    monkeypatch.setattr(pools.ray, "kill", lambda handle, no_restart: None)
    monkeypatch.setattr(c, "_give_back", lambda slot: None)
    c.drain_worker("prefill-0", timeout_s=0.0)
    assert [r.gone for r in readers] == [["prefill-0"], ["prefill-0"]]
    c.drain_worker("decode-1", timeout_s=0.0)  # a decode worker is no sender
    assert readers[0].gone == ["prefill-0"]


def test_status_says_which_process_and_host_each_worker_is(monkeypatch):
    """``tandem status`` tells an operator which process is which worker (``ps`` names a
    pool worker by its id and role only between calls: during one it is ``ray::PoolWorker.<call>``),
    and shows its host KV tier and LoRA adapters from its engine stats."""
    from engine.wire.messages import DecodeLoad

    class _Loaded(_Handle):
        def __init__(self, worker: str) -> None:
            super().__init__(worker)
            self.load = self.stats = self

    c = pools.TandemCluster(ClusterConfig(prefill_workers=0, decode_workers=1))
    slot = pools._Slot("colocated", 0, "pg", 0, WorkerRef("decode-0", _Loaded("decode-0")))
    slot.answered({"worker_id": "decode-0", "role": "decode", "pid": 4242, "node": "host-a"})
    c._slots = [slot]
    stats = {"host_cache_blocks": 64, "lora_resident_adapters": ("sql",), "num_steps": 9}
    monkeypatch.setattr(pools.ray, "get", lambda refs, timeout=None: [DecodeLoad("decode-0", 10, 10, 0, 0, 0), stats])
    (worker,) = c.status()["colocated"]
    assert (worker["pid"], worker["node"], worker["load"]["free_blocks"]) == (4242, "host-a", 10), worker
    assert worker["cache"] == {"host_cache_blocks": 64, "lora_resident_adapters": ("sql",)}, worker
