"""The pools' control loop against a fake cluster: what it observes and what it starts."""

from __future__ import annotations

import threading

from cluster.autoscaler import SLO, AutoscalingConfig, PoolBounds
from cluster.elastic import PoolScaler
from engine.wire.messages import DecodeLoad, PrefillLoad

CONFIG = AutoscalingConfig(prefill=PoolBounds(1, 2), decode=PoolBounds(1, 2), slo=SLO(ttft_ms=1000, itl_ms=50),
                           interval_s=5, scale_down_delay_s=10)  # fmt: skip


def _stats(prompt_tokens=0, num_steps=0, forward_s=0.0) -> dict:
    return {"prompt_tokens": prompt_tokens, "num_steps": num_steps, "forward_s": forward_s}


class FakeCluster:
    def __init__(self) -> None:
        self.prefill = [("prefill-0", _stats(), PrefillLoad("prefill-0", 0, 0, 0, 0, 0))]
        self.decode = [("decode-0", _stats(), DecodeLoad("decode-0", 100, 100, 0, 0, 0)),
                       ("decode-1", _stats(), DecodeLoad("decode-1", 100, 100, 1, 0, 0))]
        self.added: list[str] = []
        self.drained: list[tuple[str, float]] = []
        self.switched: list[tuple[str, str, float]] = []
        self.release = threading.Event()
        self.release.set()

    def pool_state(self):
        return {"prefill": list(self.prefill), "decode": list(self.decode)}

    def add_worker(self, role):
        self.release.wait(5)
        self.added.append(role)

    def drain_worker(self, worker_id, timeout_s):
        self.drained.append((worker_id, timeout_s))

    def switch_worker(self, worker_id, role, timeout_s):
        self.release.wait(5)
        self.switched.append((worker_id, role, timeout_s))


def _settle(scaler: PoolScaler) -> None:
    for thread in scaler._threads:
        thread.join(5)


def test_a_prefill_queue_that_clears_slower_than_the_ttft_slo_adds_a_prefill_worker():
    cluster = FakeCluster()
    scaler = PoolScaler(cluster, CONFIG)
    cluster.prefill = [("prefill-0", _stats(prompt_tokens=1000), PrefillLoad("prefill-0", 4000, 1, 3, 0, 0))]
    assert scaler.step(0.0) == [], "the first round has no rate to judge the queue by"
    # 5 s later: 2000 more prompt tokens taken in, the queue grew by 1000: 200 tokens/s prefilled,
    # 5000 queued: 25 s to clear, against a 1 s TTFT.
    cluster.prefill = [("prefill-0", _stats(prompt_tokens=3000), PrefillLoad("prefill-0", 5000, 1, 3, 0, 0))]
    seen = scaler.observe(5.0)
    assert seen["prefill"].latency_ms == 25_000 and seen["prefill"].queued == 5000
    decisions = scaler.step(10.0)
    _settle(scaler)
    assert [(d.action, d.role, d.cause) for d in decisions if d.role == "prefill"] == [("add", "prefill", "slo")]
    assert cluster.added == ["prefill"]


def test_decode_steps_slower_than_the_itl_slo_add_one_decode_worker_and_wait_for_it():
    cluster = FakeCluster()
    cluster.decode = cluster.decode[:1]
    scaler = PoolScaler(cluster, CONFIG)
    scaler.step(0.0)
    cluster.decode = [("decode-0", _stats(num_steps=100, forward_s=8.0), DecodeLoad("decode-0", 10, 100, 30, 0, 0))]
    cluster.release.clear()  # the new worker takes its time to start
    decisions = scaler.step(5.0)
    assert [(d.action, d.role) for d in decisions] == [("add", "decode")]
    assert scaler.observe(10.0)["decode"].pending == 1
    cluster.decode = [("decode-0", _stats(num_steps=200, forward_s=16.0), DecodeLoad("decode-0", 10, 100, 30, 0, 0))]
    assert scaler.step(10.0) == [], "nothing more for a role while a change of it is under way"
    cluster.release.set()
    _settle(scaler)
    assert cluster.added == ["decode"] and scaler.status()["pending"] == {"prefill": 0, "decode": 0}


def test_a_decision_to_add_several_workers_starts_each_and_waits_for_all_of_them():
    cluster = FakeCluster()
    cluster.decode = cluster.decode[:1]
    config = AutoscalingConfig(prefill=PoolBounds(1, 2), decode=PoolBounds(1, 8), slo=CONFIG.slo, interval_s=5,
                               scale_down_delay_s=10, scale_up_share=3.0)
    scaler = PoolScaler(cluster, config)
    scaler.step(0.0)
    cluster.decode = [("decode-0", _stats(num_steps=100, forward_s=8.0), DecodeLoad("decode-0", 10, 100, 30, 0, 0))]
    cluster.release.clear()
    (d,) = scaler.step(5.0)
    assert (d.action, d.role, d.count) == ("add", "decode", 3)
    assert scaler.observe(10.0)["decode"].pending == 3
    assert scaler.targets(scaler.observe(10.0), [])["decode"] == 4, "the one listed and the three on their way"
    assert scaler.status()["decisions"][-1]["count"] == 3
    cluster.release.set()
    _settle(scaler)
    assert cluster.added == ["decode"] * 3 and scaler.status()["pending"] == {"prefill": 0, "decode": 0}


def test_an_idle_decode_pool_drains_its_least_busy_worker_after_the_delay():
    cluster = FakeCluster()
    scaler = PoolScaler(cluster, CONFIG)
    decisions = [d for t in range(0, 20, 5) for d in scaler.step(float(t))]
    _settle(scaler)
    assert [(d.action, d.role, d.cause) for d in decisions] == [("remove", "decode", "idle")]
    assert cluster.drained == [("decode-0", CONFIG.drain_timeout_s)], "decode-1 still runs a request"
    assert [d["action"] for d in scaler.status()["decisions"]] == ["remove"]


class RecordingMetrics:
    def __init__(self) -> None:
        self.pools: list[tuple[dict, dict]] = []
        self.decisions: list[tuple[str, str, str]] = []
        self.switches: list[tuple[str, str]] = []

    def on_pools(self, workers, targets):
        self.pools.append((workers, targets))

    def on_decision(self, role, direction, reason):
        self.decisions.append((role, direction, reason))

    def on_role_switch(self, from_role, to_role):
        self.switches.append((from_role, to_role))


def test_a_pressed_decode_pool_takes_the_least_busy_idle_prefill_worker_warm_and_both_roles_wait_for_it():
    cluster, metrics = FakeCluster(), RecordingMetrics()
    cluster.prefill = [("prefill-0", _stats(), PrefillLoad("prefill-0", 0, 1, 0, 0, 0)),
                       ("prefill-1", _stats(), PrefillLoad("prefill-1", 0, 0, 0, 0, 0))]
    cluster.decode = cluster.decode[:1]
    config = AutoscalingConfig(**{**CONFIG.__dict__, "allow_role_switch": True})
    scaler = PoolScaler(cluster, config, metrics)
    for t in (0.0, 5.0):  # the prefill pool idles; decode steps take 10 ms, within the ITL SLO
        cluster.decode = [("decode-0", _stats(num_steps=int(20 * t), forward_s=0.2 * t),
                           DecodeLoad("decode-0", 50, 100, 8, 0, 0))]
        assert scaler.step(t) == []
    cluster.decode = [("decode-0", _stats(num_steps=200, forward_s=6.3),  # 100 more steps, 53 ms each
                       DecodeLoad("decode-0", 50, 100, 8, 0, 0))]
    cluster.release.clear()  # the switch takes its time
    decisions = scaler.step(10.0)  # the prefill pool has idled for scale_down_delay_s (10 s)
    assert [(d.action, d.role, d.cause) for d in decisions] == [("switch", "decode", "slo")]
    assert scaler.status()["pending"] == {"prefill": 1, "decode": 1}, "a switch is under way for both roles"
    assert metrics.pools[-1] == ({"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 2})
    assert scaler.step(15.0) == [], "neither role changes again while the switch runs"
    cluster.release.set()
    _settle(scaler)
    assert cluster.switched == [("prefill-1", "decode", config.drain_timeout_s)], "prefill-0 had a chunk running"
    assert ("decode", "up", "slo") in metrics.decisions and ("prefill", "down", "switch") in metrics.decisions
    assert metrics.switches == [], "the cluster counts a switch once it is done (TandemCluster.on_role_switch)"
    assert scaler.status()["pending"] == {"prefill": 0, "decode": 0}


def test_what_the_routers_clients_saw_presses_a_role_the_workers_own_estimates_call_fine():
    """Prompts queue at the prefill pool, but it clears them fast by its own estimate; the
    routers report a p90 TTFT over the SLO (requests wait elsewhere too: admission,
    transfers). The prefill pool gets a worker; the decode pool, whose clients' ITL is
    fine, does not. With nothing queued at the prefill pool, the same TTFT is not its
    doing: it stays as it is."""
    from router.latency import LatencyReport

    cluster = FakeCluster()
    cluster.decode = cluster.decode[:1]
    seen = {"report": LatencyReport(ttft_ms=1400.0, itl_ms=20.0, requests=30, tokens=900)}
    scaler = PoolScaler(cluster, CONFIG, latency=lambda: seen["report"])
    cluster.prefill = [("prefill-0", _stats(prompt_tokens=1000), PrefillLoad("prefill-0", 200, 1, 0, 0, 0))]
    scaler.step(0.0)
    cluster.prefill = [("prefill-0", _stats(prompt_tokens=21000), PrefillLoad("prefill-0", 200, 1, 0, 0, 0))]
    decisions = scaler.step(5.0)  # 4000 tokens/s prefilled, 200 queued: 50 ms by its own estimate
    _settle(scaler)
    assert [(d.action, d.role, d.cause) for d in decisions] == [("add", "prefill", "slo")]
    assert "TTFT 1400 ms over the SLO's 1000 ms" in decisions[0].reason

    idle = FakeCluster()  # its prefill worker has nothing queued
    quiet = PoolScaler(idle, CONFIG, latency=lambda: seen["report"])
    assert quiet.observe(0.0)["prefill"].latency_ms is None
    seen["report"] = None  # no request lately: the workers' own estimates only
    cluster.prefill = [("prefill-0", _stats(prompt_tokens=41000), PrefillLoad("prefill-0", 200, 1, 0, 0, 0))]
    assert scaler.observe(10.0)["prefill"].latency_ms == 50.0


def test_a_worker_that_does_not_answer_still_counts_against_the_pools_maximum():
    """Under load a worker may not answer the round's poll in time: it is still listed,
    so a pressed pool at its maximum adds none (it once grew past ``max_workers``)."""
    cluster = FakeCluster()
    scaler = PoolScaler(cluster, CONFIG)  # decode: max_workers 2, two listed
    scaler.step(0.0)
    cluster.decode = [("decode-0", _stats(num_steps=100, forward_s=8.0), DecodeLoad("decode-0", 10, 100, 30, 0, 0)),
                      ("decode-1", None, None)]  # 80 ms steps: over the ITL SLO; decode-1 silent
    seen = scaler.observe(5.0)
    assert seen["decode"].workers == 2 and seen["decode"].latency_ms == 80
    assert [d for d in scaler.policy.decide(seen, 5.0) if d.role == "decode"] == []


def test_an_add_that_ends_while_the_pools_are_read_is_not_made_twice():
    """The pools were read before the added worker was listed, and the add ended while
    they were read: the round must see it as still under way, not as a pool one short
    with nothing under way (the pools once grew past ``max_workers`` this way)."""
    cluster = FakeCluster()
    cluster.decode = cluster.decode[:1]
    scaler = PoolScaler(cluster, CONFIG)
    busy = [("decode-0", _stats(num_steps=100, forward_s=8.0), DecodeLoad("decode-0", 10, 100, 30, 0, 0))]
    scaler.step(0.0)
    cluster.decode = busy
    cluster.release.clear()
    assert [(d.action, d.role) for d in scaler.step(5.0)] == [("add", "decode")]
    snapshot = cluster.pool_state

    def read_while_the_add_ends():
        state = snapshot()  # the new worker is not listed yet ...
        cluster.release.set()  # ... when the add ends
        _settle(scaler)
        return state

    cluster.pool_state = read_while_the_add_ends
    cluster.decode = [(wid, _stats(num_steps=200, forward_s=16.0), load) for wid, _, load in busy]
    assert [d for d in scaler.step(10.0) if d.role == "decode"] == [], "the add under way was made again"
    assert cluster.added == ["decode"]
