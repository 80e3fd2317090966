"""The pools' scaling policy as a pure function of what it observes and the time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.autoscaler import SLO, Autoscaler, AutoscalingConfig, Decision, PoolBounds, RoleObservation

CONFIG = AutoscalingConfig(
    prefill=PoolBounds(1, 3), decode=PoolBounds(1, 3), slo=SLO(ttft_ms=1000, itl_ms=50),
    interval_s=5, scale_down_delay_s=30, allow_role_switch=True,
)  # fmt: skip
BUSY_P = RoleObservation(workers=1, latency_ms=1500)  # TTFT over the SLO
BUSY_D = RoleObservation(workers=1, latency_ms=80)  # ITL over the SLO
QUIET_P = RoleObservation(workers=2, latency_ms=100)
QUIET_D = RoleObservation(workers=2, latency_ms=10)
BAND_P = RoleObservation(workers=2, latency_ms=700)  # between low water (500) and the SLO
BAND_D = RoleObservation(workers=2, latency_ms=40)


def _run(scaler: Autoscaler, seen: dict, times) -> list[tuple[float, Decision]]:
    return [(t, d) for t in times for d in scaler.decide(seen, t)]


def test_a_role_over_its_slo_gets_one_more_worker_and_nothing_more_while_it_starts():
    scaler = Autoscaler(CONFIG)
    assert scaler.decide({"prefill": BUSY_P, "decode": BAND_D}, 0) == [
        Decision("add", "prefill", "TTFT 1500 ms over the SLO's 1000 ms", "slo")
    ]
    starting = RoleObservation(workers=1, pending=1, latency_ms=1500)
    assert scaler.decide({"prefill": starting, "decode": BAND_D}, 5) == []
    at_max = RoleObservation(workers=3, latency_ms=1500)
    assert scaler.decide({"prefill": at_max, "decode": BAND_D}, 10) == [], "no worker past max_workers"


@pytest.mark.parametrize("share,workers,added", [(0.5, 4, 2), (0.5, 5, 3), (0.5, 9, 1), (1.0, 2, 2), (0.0, 4, 1),
                                                   (0.5, 1, 1)])
def test_a_pressed_role_starts_a_share_of_its_workers_at_once_up_to_its_maximum(share, workers, added):
    """A pool adding one worker a minute cannot follow a ramp: it starts ``scale_up_share``
    of its workers at once, at least one, never past ``max_workers`` (10 here)."""
    config = AutoscalingConfig(decode=PoolBounds(1, 10), slo=SLO(ttft_ms=1000, itl_ms=50), scale_up_share=share)
    (d,) = Autoscaler(config).decide({"prefill": BAND_P, "decode": RoleObservation(workers, latency_ms=80)}, 0)
    assert (d.action, d.role, d.count) == ("add", "decode", added)


@pytest.mark.parametrize("role,seen,why", [
    ("prefill", RoleObservation(workers=1, queued=9000), "9000 prompt tokens queued"),
    ("decode", RoleObservation(workers=1, queued=3, kv_usage=0.95), "3 requests wait with KV 95% full"),
])  # fmt: skip
def test_work_waiting_without_room_presses_a_role_before_its_latency_shows_it(role, seen, why):
    other = {"prefill": BAND_P, "decode": BAND_D}
    decisions = Autoscaler(CONFIG).decide({**other, role: seen}, 0)
    assert [(d.action, d.role) for d in decisions] == [("add", role)] and why in decisions[0].reason
    waiting_with_room = RoleObservation(workers=1, queued=3, kv_usage=0.5)
    assert Autoscaler(CONFIG).decide({"prefill": BAND_P, "decode": waiting_with_room}, 0) == []


def test_an_idle_role_gives_a_worker_up_only_after_the_delay_and_never_below_its_minimum():
    scaler = Autoscaler(CONFIG)
    decisions = _run(scaler, {"prefill": QUIET_P, "decode": BAND_D}, range(0, 70, 5))
    assert [(t, d.action, d.role) for t, d in decisions] == [(30, "remove", "prefill"), (65, "remove", "prefill")], \
        "one worker per delay: the idle stretch starts again after each change"
    at_min = RoleObservation(workers=1, latency_ms=100)
    assert _run(Autoscaler(CONFIG), {"prefill": at_min, "decode": BAND_D}, range(0, 120, 5)) == []


def test_a_blip_out_of_idle_starts_the_delay_again():
    scaler = Autoscaler(CONFIG)
    for t in range(0, 30, 5):
        assert scaler.decide({"prefill": QUIET_P, "decode": BAND_D}, t) == []
    assert scaler.decide({"prefill": BAND_P, "decode": BAND_D}, 30) == []  # busier, not pressed
    assert _run(scaler, {"prefill": QUIET_P, "decode": BAND_D}, range(35, 65, 5)) == []
    assert [d.action for d in scaler.decide({"prefill": QUIET_P, "decode": BAND_D}, 65)] == ["remove"]


def test_a_pressed_role_takes_a_warm_worker_from_an_idle_one_rather_than_starting_one():
    scaler = Autoscaler(CONFIG)
    for t in range(0, 30, 5):
        scaler.decide({"prefill": QUIET_P, "decode": BAND_D}, t)
    busy_decode = RoleObservation(workers=2, latency_ms=80)
    assert [(d.action, d.role) for d in scaler.decide({"prefill": QUIET_P, "decode": busy_decode}, 30)] == [
        ("switch", "decode")
    ]
    # Without role switching, the same moment adds a decode worker and removes a prefill one.
    plain = Autoscaler(AutoscalingConfig(**{**CONFIG.__dict__, "allow_role_switch": False}))
    for t in range(0, 30, 5):
        plain.decide({"prefill": QUIET_P, "decode": BAND_D}, t)
    assert [(d.action, d.role) for d in plain.decide({"prefill": QUIET_P, "decode": busy_decode}, 30)] == [
        ("add", "decode"), ("remove", "prefill")
    ]


def test_at_its_maximum_a_pressed_role_can_only_take_a_worker_from_an_idle_one():
    scaler = Autoscaler(CONFIG)
    at_max = RoleObservation(workers=3, latency_ms=80)
    assert scaler.decide({"prefill": BAND_P, "decode": at_max}, 0) == []
    for t in range(0, 30, 5):
        assert scaler.decide({"prefill": QUIET_P, "decode": at_max}, t) == []
    assert [d.action for d in scaler.decide({"prefill": QUIET_P, "decode": at_max}, 30)] == ["switch"]


band = st.builds(
    lambda p, d, wp, wd: {"prefill": RoleObservation(workers=wp, latency_ms=p),
                          "decode": RoleObservation(workers=wd, latency_ms=d)},
    st.floats(500, 1000), st.floats(25, 50), st.integers(1, 3), st.integers(1, 3),
)  # fmt: skip


@settings(max_examples=50, deadline=None)
@given(st.lists(band, min_size=1, max_size=40))
def test_in_the_hysteresis_band_nothing_ever_changes(observations):
    scaler = Autoscaler(CONFIG)
    assert [d for i, seen in enumerate(observations) for d in scaler.decide(seen, 5 * i)] == []


def test_a_load_ramp_scales_out_to_the_maximum_and_back_in_without_flapping():
    """A model service: latency grows with the load per worker; a change takes one
    interval to land. Low, high, then low load for 10 minutes."""
    scaler = Autoscaler(CONFIG)
    workers = {"prefill": 1, "decode": 1}
    pending: list[tuple[float, str, int]] = []  # (lands at, role, change)
    history = []
    for t in range(0, 600, 5):
        load = 3.0 if 120 <= t < 360 else 0.4  # requests/s
        for due in [p for p in pending if p[0] <= t]:
            pending.remove(due)
            workers[due[1]] += due[2]
        seen = {
            "prefill": RoleObservation(workers["prefill"], sum(r == "prefill" for _, r, _ in pending),
                                       latency_ms=900 * load / workers["prefill"]),
            "decode": RoleObservation(workers["decode"], sum(r == "decode" for _, r, _ in pending),
                                      latency_ms=40 * load / workers["decode"]),
        }  # fmt: skip
        for d in scaler.decide(seen, t):
            history.append((t, d.action, d.role))
            if d.action == "switch":
                other = "prefill" if d.role == "decode" else "decode"
                pending += [(t + 5, d.role, +1), (t + 5, other, -1)]
            else:
                pending.append((t + 5, d.role, +1 if d.action == "add" else -1))
        assert all(1 <= n <= 3 for n in workers.values()), (t, workers)
        if t == 355:
            assert workers == {"prefill": 3, "decode": 3}, f"scaled out under the high load: {history}"
    assert workers == {"prefill": 1, "decode": 1}, f"back to the minimum once the load fell: {history}"
    assert len(history) == 8, f"2 out and 2 in per role, nothing more: {history}"


def test_settings_are_checked_where_they_are_read():
    cfg = AutoscalingConfig.from_dict({"prefill": {"min_workers": 2, "max_workers": 4}, "slo": {"itl_ms": 30}})
    assert cfg.prefill == PoolBounds(2, 4) and cfg.slo.itl_ms == 30 and cfg.decode == PoolBounds(1, 1)
    with pytest.raises(ValueError, match="unknown autoscaling settings"):
        AutoscalingConfig.from_dict({"intervals": 3})
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        PoolBounds(3, 2)
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match=f"{role}.min_workers must be >= 1"):
            AutoscalingConfig(**{role: PoolBounds(0, 2)})
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        AutoscalingConfig(interval_s=0)
    with pytest.raises(ValueError, match=r"scale_up_share must be in \[0, 4\], got -0.5"):
        AutoscalingConfig.from_dict({"scale_up_share": -0.5})


def test_a_topology_s_autoscaling_section_is_checked_against_its_pool_sizes():
    from cluster.config import ClusterConfig

    cfg = ClusterConfig.from_dict({"prefill_workers": 1, "decode_workers": 2,
                                   "autoscaling": {"decode": {"min_workers": 1, "max_workers": 3}}})  # fmt: skip
    assert cfg.autoscaling.decode == PoolBounds(1, 3) and cfg.autoscaling.prefill == PoolBounds(1, 1)
    with pytest.raises(ValueError, match=r"decode_workers \(3\) must be within autoscaling.decode \[1, 2\]"):
        ClusterConfig.from_dict({"decode_workers": 3, "autoscaling": {"decode": {"max_workers": 2}}})
    assert ClusterConfig.from_dict({"autoscaling": {"allow_role_switch": True}}).role_switch_problem() is None
    with pytest.raises(ValueError, match="allow_role_switch: the prefill and decode engines differ in num_kv_blocks"):
        ClusterConfig.from_dict({"decode_engine": {"num_kv_blocks": 64}, "autoscaling": {"allow_role_switch": True}})
    with pytest.raises(ValueError, match="allow_role_switch: prefill_resources .* differ"):
        ClusterConfig.from_dict({"decode_resources": {"num_cpus": 0.5}, "autoscaling": {"allow_role_switch": True}})
    # Scheduler settings may differ: a switch resets them.
    assert ClusterConfig.from_dict({"decode_engine": {"max_num_seqs": 8}, "autoscaling": {"allow_role_switch": True}})
    assert ClusterConfig().autoscaling is None, "pools keep their sizes unless asked"
