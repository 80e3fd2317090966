"""The planner's elastic step: traffic over a day (``RateProfile``), device-seconds counted
as the pools change, and scaling bounds chosen by simulating the controller's own policy."""

from __future__ import annotations

import math

import pytest

from cluster.autoscaler import SLO, AutoscalingConfig
from router.admission import AdmissionConfig
from sim.bounds import elastic_topology, floor_shares, plan_bounds
from sim.cost import model_spec
from sim.fitting import cost_model
from sim.report import SloTarget, summary
from sim.simulator import run
from sim.topology import RouterSettings, SimTopology
from sim.workload import RateProfile, generate_profile, parse_spec

COST = cost_model("H100", model_spec("llama-3.1-8b"))
SLO_TARGET = SloTarget(ttft_ms=200, itl_ms=10)
SPEC = parse_spec("synthetic:in=256,out=64,range=0.5,seed=1")
# 4 colocated workers sustain about 140 req/s of SPEC under SLO_TARGET (90%: 1 at 130, 0.88 at 140).
CEILING = SimTopology(prefill_workers=0, decode_workers=4, worker_start_s=2.0,
                      router=RouterSettings(admission=AdmissionConfig(max_requests=10**9, max_prompt_tokens=10**12)))
SCALING = AutoscalingConfig(slo=SLO(ttft_ms=200, itl_ms=10), interval_s=1.0, scale_down_delay_s=5.0)
DAY = RateProfile.day(low=20, peak=130, phase_s=10)


def test_a_profile_inverts_its_rate_integral_and_arrivals_follow_its_rate():
    p = RateProfile.day(low=10, peak=40, phase_s=30)
    assert p.duration_s == 150 and (p.low, p.peak) == (10, 40)
    assert p.expected() == pytest.approx(30 * (10 + 25 + 40 + 25 + 10))
    # Inside the ramp up, the mean count is 300 + 10 t + (30 / 60) t^2 at t seconds into it.
    assert p.time_at(300) == pytest.approx(30)
    assert p.time_at(300 + 10 * 12 + 0.5 * 12**2) == pytest.approx(42)
    assert p.time_at(p.expected() + 1) == math.inf
    requests = generate_profile(parse_spec("sharegpt:seed=2"), p)
    per_phase = [sum(1 for r in requests if 30 * k <= r.arrival_s < 30 * (k + 1)) for k in range(5)]
    for seen, mean in zip(per_phase, (300, 750, 1200, 750, 300)):
        assert abs(seen - mean) < 4 * math.sqrt(mean), per_phase
    assert requests == generate_profile(parse_spec("sharegpt:seed=2"), p)  # seeded


def test_a_profile_refuses_segments_without_time_or_rate():
    with pytest.raises(ValueError, match="seconds > 0"):
        RateProfile(((0.0, 1.0, 1.0),))
    with pytest.raises(ValueError, match="not both 0"):
        RateProfile(((5.0, 0.0, 0.0),))
    with pytest.raises(ValueError, match="at least one segment"):
        RateProfile(())


def test_device_seconds_count_every_worker_while_it_is_held():
    requests = generate_profile(SPEC, DAY)
    fixed = run(CEILING, COST, requests)
    assert fixed.device_s == pytest.approx(4 * fixed.end_s)
    elastic = run(elastic_topology(CEILING, 0.25, SCALING), COST, requests)
    adds = sum(1 for _, d in elastic.scaling_decisions if d.action == "add")
    assert adds >= 1 and elastic.num_devices_max > 1
    # One device all along, and more from each add on: strictly between one and the most held.
    assert elastic.end_s < elastic.device_s < elastic.num_devices_max * elastic.end_s
    s = summary(elastic, SLO_TARGET)
    assert s["mean_devices"] == pytest.approx(elastic.device_s / elastic.end_s)


def test_floors_are_shares_of_the_ceiling_with_one_worker_at_least():
    assert floor_shares(0.2) == [0.2, 0.3, 0.4, 0.6]
    assert floor_shares(0.5) == [0.5, 0.75]  # 1.0 and over: the fixed pools, simulated anyway
    topo = elastic_topology(SimTopology(prefill_workers=2, decode_workers=6), 0.1, SCALING)
    a = topo.autoscaling
    assert (topo.prefill_workers, topo.decode_workers) == (1, 1)
    assert (a.prefill.min_workers, a.prefill.max_workers, a.decode.min_workers, a.decode.max_workers) == (1, 2, 1, 6)
    assert elastic_topology(SimTopology(prefill_workers=2, decode_workers=6), 0.5, SCALING).decode_workers == 3


def test_the_floor_chosen_meets_the_slo_over_the_day_on_fewer_device_seconds():
    requests = generate_profile(SPEC, DAY)
    bounds = plan_bounds(CEILING, 140, COST, requests, DAY, SLO_TARGET, SCALING)
    assert bounds.fixed.topology.autoscaling is None and bounds.fixed.meets(SLO_TARGET)
    chosen = bounds.chosen
    assert chosen is not bounds.fixed and chosen.meets(SLO_TARGET)
    assert chosen.topology.autoscaling.decode.min_workers < 4 == chosen.topology.autoscaling.decode.max_workers
    assert chosen.device_s < bounds.fixed.device_s and 0 < bounds.saved < 1
    assert chosen.device_s == min(t.device_s for t in bounds.trials if t.meets(SLO_TARGET))


def test_pools_that_cannot_grow_in_time_keep_the_fixed_ceiling():
    # A worker that takes longer to start than the day lasts never helps at the peak.
    requests = generate_profile(SPEC, DAY)
    slow = CEILING.replace(worker_start_s=1000.0)
    bounds = plan_bounds(slow, 140, COST, requests, DAY, SLO_TARGET, SCALING)
    assert bounds.trials and not any(t.meets(SLO_TARGET) for t in bounds.trials)
    assert bounds.chosen is bounds.fixed and bounds.saved == 0


def test_each_floor_is_tried_with_each_scale_up_share_and_one_that_keeps_up_with_the_ramp_is_chosen():
    # Workers that take 4 s to start: from one worker, adding one at a time reaches four
    # after three starts, doubling after two, and only that keeps up with the ramp.
    requests = generate_profile(SPEC, DAY)
    slow = CEILING.replace(worker_start_s=4.0)
    bounds = plan_bounds(slow, 140, COST, requests, DAY, SLO_TARGET, SCALING, factors=(1.0,), scale_up_shares=(0.0, 1.0))
    one_at_a_time, doubling = bounds.trials
    assert [t.label() for t in bounds.trials] == ["elastic colocated 1-4 scale-up 0", "elastic colocated 1-4 scale-up 1"]
    assert not one_at_a_time.meets(SLO_TARGET) and doubling.meets(SLO_TARGET)
    assert bounds.chosen is doubling and bounds.chosen.topology.autoscaling.scale_up_share == 1.0
