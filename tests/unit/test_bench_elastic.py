"""``bench.elastic``'s arithmetic: phased arrival schedules, goodput in a window, SLO
attainment per window and the time to get back within the SLO."""

from __future__ import annotations

from bench.elastic import Phase, attainment, goodput, recovery_s, schedule, slo_from
from load.results import RequestResult, Slo

SLO = Slo(ttft_ms=100, tpot_ms=10)


def _result(sent_s: float, ttft_s: float, ok: bool = True) -> RequestResult:
    r = RequestResult(0, "", 8, 4, sent_s=sent_s, ok=ok, ttft_s=ttft_s, e2e_s=ttft_s + 0.015, output_tokens=4)
    return r  # TPOT 5 ms


def test_a_schedule_runs_its_phases_one_after_the_other_at_their_rates():
    plan = schedule([Phase("low", 10, 2.0, 8, 4), Phase("high", 10, 20.0, 16, 2)], vocab=list(range(100)), seed=0)
    low = [t for t, r in zip(plan.times, plan.requests) if r.group == "low"]
    high = [t for t, r in zip(plan.times, plan.requests) if r.group == "high"]
    assert all(0 <= t < 10 for t in low) and all(10 <= t < 20 for t in high)
    assert 8 <= len(low) <= 35 and 140 <= len(high) <= 260, (len(low), len(high))
    assert plan.times == sorted(plan.times)
    assert {len(r.prompt_token_ids) for r in plan.requests if r.group == "high"} == {16}


def test_goodput_counts_requests_sent_in_the_window_that_met_the_slo():
    results = [_result(1, 0.05), _result(2, 0.5), _result(3, 0.05, ok=False), _result(12, 0.05)]
    assert goodput(results, SLO, 0, 10) == 0.1  # one of three in the window met it


def test_recovery_is_the_first_window_after_the_flip_from_which_every_window_meets_the_share():
    results = [_result(t, 0.05) for t in range(0, 10)]  # before the flip: fine
    results += [_result(t, 0.5) for t in range(10, 20)]  # after the flip: over the SLO for 10 s
    results += [_result(t, 0.05) for t in range(20, 35)]
    results += [_result(25.5, 0.5)]  # one miss of six in [25, 30): 83%
    windows = attainment(results, SLO, window_s=5)
    assert [w["met"] for w in windows] == [1.0, 1.0, 0.0, 0.0, 1.0, 0.83, 1.0]
    assert recovery_s(windows, flip_s=10) == 20.0
    assert recovery_s(windows[:6], flip_s=10) is None, "the load ended out of the SLO"


def test_scaling_times_come_from_the_decisions_dates_and_the_pool_sizes_seen():
    from bench.elastic import _scaling_times

    samples = [(0.0, 1, 1), (21.0, 1, 1), (24.0, 1, 2), (30.0, 2, 2), (80.0, 1, 1)]
    decisions = [(5.0, "remove", "decode"), (22.5, "add", "decode"), (26.0, "add", "prefill")]
    times = _scaling_times(samples, decisions, step_s=20.0)
    assert times["s_to_first_scale_out"] == 2.5 and times["s_to_largest_pools"] == 10.0
    assert times["largest_pools"] == {"prefill": 2, "decode": 2}


def test_the_slo_is_a_factor_of_the_fixed_pools_p90s():
    from load.results import RequestResult

    results = []
    for i in range(10):
        ttft, tpot = 0.1 * (i + 1), 0.01 * (i + 1)  # 9 gaps of tpot after the first token
        results.append(RequestResult(i, "fixed", 16, 8, ok=True, ttft_s=ttft, e2e_s=ttft + 9 * tpot, output_tokens=10))
    slo = slo_from(results, 2.0)
    assert (slo.ttft_ms, slo.tpot_ms) == (1820.0, 182.0), slo  # 2 x the p90s, 0.91 s and 91 ms
