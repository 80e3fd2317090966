"""The planner: rate matching keeps the colocated unit and the best splits, the bisection finds a
rate the chosen configuration really sustains, and its topology file is a valid Tandem one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.admission import AdmissionConfig
from sim.cli import best_topology, helm_values
from sim.cost import model_spec
from sim.fitting import cost_model
from sim.planner import Candidate, PlanSettings, candidates, estimate, mean_lengths, plan, prune, trial, unit_size
from sim.report import SloTarget
from sim.topology import RouterSettings, SimTopology
from sim.workload import parse_spec

COST = cost_model("H100", model_spec("llama-3.1-8b"))
BASE = SimTopology(router=RouterSettings(admission=AdmissionConfig(max_requests=10**9, max_prompt_tokens=10**12)))
SLO = SloTarget(ttft_ms=200, itl_ms=20)
SPEC = parse_spec("sharegpt:seed=3")
SMALL = PlanSettings(chunks=(2048,), batch_caps=(128,), max_unit=3, keep=1, iters=2, trial_s=3, warmup_s=3, min_requests=60,
                     max_requests=300)


@pytest.fixture(scope="module")
def planned():
    return plan(3, BASE, COST, SPEC, SLO, SMALL, verify=False)


def test_units_are_the_largest_divisor_up_to_the_cap():
    assert [unit_size(n, 8) for n in (4, 8, 12, 64, 7, 9)] == [4, 8, 6, 8, 7, 3]


def test_rate_matching_keeps_the_colocated_unit_and_the_best_splits():
    s = PlanSettings(chunks=(2048,), batch_caps=(256,), keep=2)
    cands = candidates(8, s)
    lengths = mean_lengths(SPEC)
    estimates = {c: estimate(c, BASE, COST, lengths, SLO) for c in cands}
    kept = prune(cands, estimates, s)
    splits = {(c.prefill_workers, c.decode_workers) for c in kept}
    assert (0, 8) in splits and len(splits) <= 3
    best_split = max((c for c in cands if not c.colocated), key=estimates.get)
    assert (best_split.prefill_workers, best_split.decode_workers) in splits


def test_a_decode_worker_sustains_more_under_a_looser_itl_limit():
    c = Candidate(1, 1, 2048, 256)
    lengths = mean_lengths(SPEC)
    tight = estimate(c, BASE, COST, lengths, SloTarget(1000, 10))
    loose = estimate(c, BASE, COST, lengths, SloTarget(1000, 40))
    assert loose > tight


def test_the_planned_configuration_meets_the_slo_at_the_rate_it_reports(planned):
    result = planned
    best = result.best
    assert best.rate > 0 and best.summary is not None
    assert best.summary["slo_attainment"] >= SLO.attainment
    assert all(best.rate >= e.rate for e in result.ranked)
    assert result.best_colocated is not None and result.best_colocated.candidate.colocated
    # Re-simulated on its own at the rate found, it still meets the SLO (same trace, same numbers).
    again = trial(best.candidate, BASE, COST, SPEC, SLO, best.rate, SMALL)
    assert again["slo_attainment"] == best.summary["slo_attainment"]
    # ... and at twice that rate it does not.
    over = trial(best.candidate, BASE, COST, SPEC, SLO, 2 * best.rate, SMALL)
    assert over["slo_attainment"] < SLO.attainment


def test_the_planned_topology_loads_as_a_tandem_topology_and_helm_values_agree(planned):
    from cluster.config import ClusterConfig

    topo = best_topology(planned, BASE, COST)
    cluster = ClusterConfig.from_dict(topo.to_topology())
    assert (cluster.prefill_workers, cluster.decode_workers) == (topo.prefill_workers, topo.decode_workers)
    assert cluster.engine_config("decode").num_kv_blocks == COST.kv_blocks_fitting(16)
    values = helm_values(topo)
    assert values["decode"]["replicas"] == topo.decode_workers
    assert values["serve"]["topology"]["decode_workers"] == topo.decode_workers


def test_one_device_cannot_be_planned():
    with pytest.raises(ValueError, match="--devices must be >= 2"):
        plan(1, BASE, COST, SPEC, SLO, SMALL)


def test_simulated_whole_the_cluster_is_held_to_the_slo_and_backs_off_until_it_meets_it(planned):
    from sim.planner import whole_cluster

    best = planned.best
    rate, res = whole_cluster(best, BASE, COST, SPEC, SLO, SMALL, replicas=2)
    assert 0 < rate <= 2 * best.rate
    assert res["slo_attainment"] >= SLO.attainment
    # Far over what it sustains, with no back-off left: it reports nothing sustained.
    rate, res = whole_cluster(replace(best, rate=4 * best.rate), BASE, COST, SPEC, SLO, SMALL, replicas=2, backoffs=0)
    assert rate == 0.0 and res["slo_attainment"] < SLO.attainment


def test_a_trial_counts_only_the_requests_sent_after_its_warm_up():
    s = replace(SMALL, warmup_s=2.0, trial_s=5.0)
    res = trial(Candidate(1, 1, 2048, 128), BASE, COST, SPEC, SLO, 20.0, s)
    assert res["warmup_requests"] == 40  # 2 s at 20 req/s, then 5 s more counted (100, within 60..300)
    assert res["completed"] + res["failed"] == 100
    cold = trial(Candidate(1, 1, 2048, 128), BASE, COST, SPEC, SLO, 20.0, replace(s, warmup_s=0.0))
    assert cold["warmup_requests"] == 0 and cold["completed"] + cold["failed"] == 100
