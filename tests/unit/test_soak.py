"""The soak program's pure parts: the trend judgement, the verdict over samples, the
seeded cancellation choice, and the per-window tallies. No Ray, no sockets."""

from __future__ import annotations

import random

import pytest

from bench.soak import LoadPlan, arrivals
from bench.soak_report import markdown
from bench.soak_samples import Tally, process_label
from bench.soak_verdict import MB, CancelPoint, TrendRule, choose_cancel, fit_trend, judge, judge_blocks, judge_rss
from load.results import RequestResult

LOAD_S = 600.0
TIMES = [5.0 * i for i in range(121)]  # a sample every 5 s over the load


def noisy(level: float, sigma: float, slope: float = 0.0, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level + slope * t + rng.gauss(0, sigma) for t in TIMES]


def test_fit_trend_recovers_a_line_and_needs_three_points():
    trend = fit_trend([0, 1, 2, 3], [1, 3, 5, 7])
    assert trend.slope == pytest.approx(2.0) and trend.intercept == pytest.approx(1.0)
    assert trend.resid_std == pytest.approx(0.0, abs=1e-9)
    assert fit_trend([0, 1], [1, 2]) is None


@pytest.mark.parametrize("seed", range(5))
def test_flat_noisy_rss_passes(seed):
    rss = noisy(400 * MB, 8 * MB, seed=seed)  # 2 % scatter, no trend
    j = judge_rss("decode-0", TIMES, rss, LOAD_S)
    assert j.ok, j.message


def test_rss_rising_past_the_bound_fails():
    rss = noisy(400 * MB, 2 * MB, slope=0.1 * MB)  # +60 MB over 600 s
    j = judge_rss("router-replica", TIMES, rss, LOAD_S)
    assert not j.ok and "GROWS" in j.message
    assert j.projected == pytest.approx(60 * MB, rel=0.1)


def test_rss_growth_under_both_bounds_passes():
    rss = noisy(400 * MB, 0.2 * MB, slope=0.02 * MB)  # +12 MB = 3 % over the load: a visible but small rise
    assert judge_rss("driver", TIMES, rss, LOAD_S).ok


def test_rss_percent_bound_catches_a_small_process():
    rss = noisy(100 * MB, 0.5 * MB, slope=0.02 * MB)  # +12 MB = 12 % of 100 MB, under 50 MB
    assert not judge_rss("serve-proxy", TIMES, rss, LOAD_S).ok


def test_rss_is_judged_on_the_second_half_only():
    # Warm-up: a steep climb in the first half, flat after it.
    rss = [300 * MB + min(t, 200) * 0.5 * MB + (t % 10) * 0.01 * MB for t in TIMES]
    assert judge_rss("prefill-0", TIMES, rss, LOAD_S).ok


def test_flat_noisy_blocks_pass_and_rising_blocks_fail():
    rng = random.Random(1)
    flat = [max(0, round(rng.gauss(120, 40))) for _ in TIMES]
    assert judge_blocks("decode-0", TIMES, flat, LOAD_S).ok
    rising = [b + t * 0.5 for b, t in zip(flat, TIMES)]  # ~300 blocks leaked over the load
    j = judge_blocks("decode-0", TIMES, rising, LOAD_S)
    assert not j.ok and "RISE" in j.message


def test_a_rise_small_against_the_pool_passes():
    rng = random.Random(2)
    drift = [max(0, round(rng.gauss(120, 10))) + t * 0.05 for t in TIMES]  # +30 blocks over the load
    assert not judge_blocks("decode-0", TIMES, drift, LOAD_S).ok  # beyond noise, with no pool to weigh it
    j = judge_blocks("decode-0", TIMES, drift, LOAD_S, pool_blocks=10_000)  # 0.3 % of the pool
    assert j.ok and "% of its 10000 blocks" in j.message


def test_idle_blocks_pass():
    assert judge_blocks("prefill-0", TIMES, [0] * len(TIMES), LOAD_S).ok


def sample(t, phase, rss_mb, blocks, in_flight=3):
    return {
        "t": t, "phase": phase, "in_flight": in_flight,
        "rss": {name: {"pid": 10 + i, "rss": mb * MB} for i, (name, mb) in enumerate(rss_mb.items())},
        "blocks": blocks,
        "workers": {w: {"blocks_in_use": n, "num_blocks": 2000} for w, n in blocks.items()},
        "window": {"completed": 1, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "itl_p99_ms": 5.0, "e2e_p99_ms": 300.0},
    }


def run_samples(leak_mb_per_s=0.0, leak_blocks_per_s=0.0):
    return [
        sample(t, "baseline" if t == 0 else "load",
               {"driver": 200 + leak_mb_per_s * t, "decode-0": 600, "raylet": 50 + 0.2 * t},
               {"prefill-0": 0, "decode-0": 40 + (t % 15) + int(leak_blocks_per_s * t)})
        for t in TIMES
    ]


def test_verdict_passes_a_clean_run_and_ignores_ray_internals():
    verdict, rss, blocks = judge(run_samples(), LOAD_S, {"prefill-0": 0, "decode-0": 0}, hung=0)
    assert verdict.ok, verdict.failures
    raylet = next(j for j in rss if j.name == "raylet")
    assert not raylet.judged and "not judged" in raylet.message  # grows 120 MB, but it is Ray's
    assert {j.name for j in blocks} == {"prefill-0", "decode-0"}


@pytest.mark.parametrize(
    "kwargs, final, hung, expected",
    [
        ({"leak_mb_per_s": 0.2}, {"decode-0": 0}, 0, "driver: RSS GROWS"),
        ({"leak_blocks_per_s": 0.5}, {"decode-0": 3}, 0, "decode-0 blocks in use: RISE"),
        ({}, {"decode-0": 3}, 0, "did not return to 0"),
        ({}, None, 0, "could not read"),
        ({}, {"decode-0": 0}, 2, "2 request(s) hung"),
    ],
)
def test_verdict_fails_with_a_clear_reason(kwargs, final, hung, expected):
    verdict, _, _ = judge(run_samples(**kwargs), LOAD_S, final, hung)
    assert not verdict.ok
    assert any(expected in f for f in verdict.failures), verdict.failures


def test_a_block_rise_that_drains_to_zero_says_so():
    verdict, _, _ = judge(run_samples(leak_blocks_per_s=0.5), LOAD_S, {"decode-0": 0}, 0)
    assert any("RISE" in f and "returned to 0 after the drain" in f for f in verdict.failures), verdict.failures


def test_a_restarted_process_is_judged_on_its_last_pid():
    samples = run_samples()
    for s in samples:
        if s["t"] > 400:  # replaced with a fresh, smaller process
            s["rss"]["decode-0"] = {"pid": 99, "rss": 300 * MB}
    verdict, _, _ = judge(samples, LOAD_S, {"decode-0": 0}, 0)
    assert verdict.ok, verdict.failures
    assert any("changed pid" in w for w in verdict.warnings)


def test_cancel_choice_is_seeded():
    def draws(seed):
        rng = random.Random(seed)
        return [choose_cancel(rng, 0.1, 64, 0.5) for _ in range(2000)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    chosen = [p for p in draws(7) if p is not None]
    assert 150 < len(chosen) < 250  # ~10 % of 2000
    by_delay = [p for p in chosen if p.after_s is not None]
    by_chunks = [p for p in chosen if p.after_chunks is not None]
    assert by_delay and by_chunks and len(by_delay) + len(by_chunks) == len(chosen)
    assert all(0 <= p.after_s < 0.5 for p in by_delay)
    assert all(1 <= p.after_chunks <= 63 for p in by_chunks)


def test_cancel_fraction_bounds():
    rng = random.Random(0)
    assert all(choose_cancel(rng, 0.0, 64, 1.0) is None for _ in range(100))
    assert all(isinstance(choose_cancel(rng, 1.0, 64, 1.0), CancelPoint) for _ in range(100))
    with pytest.raises(ValueError, match="cancel fraction"):
        choose_cancel(rng, 1.5, 64, 1.0)


def test_arrivals_are_seeded_poisson_within_the_duration():
    plan = LoadPlan(rate=4.0, duration_s=100.0, input_len=8, output_len=8, range_ratio=0.0,
                    cancel_fraction=0.1, cancel_max_delay_s=0.5, seed=3)
    times = arrivals(plan)
    assert times == arrivals(plan)
    assert all(0 <= t < 100 for t in times) and times == sorted(times)
    assert 320 < len(times) < 480  # 400 expected


def test_tally_windows_and_pooled_percentiles():
    tally = Tally()
    done = RequestResult(0, "", 8, 4, ok=True, ttft_s=0.1, e2e_s=0.4, itl_s=[0.1, 0.1, 0.1])
    tally.record("completed", done)
    tally.record("cancelled")
    failed = RequestResult(1, "", 8, 4)
    failed.fail("http_500")
    tally.record("errored", failed)
    first = tally.close_window(5.0)
    assert (first["completed"], first["cancelled"], first["errored"]) == (1, 1, 1)
    assert first["ttft_p50_ms"] == pytest.approx(100.0) and first["e2e_p99_ms"] == pytest.approx(400.0)
    empty = tally.close_window(10.0)
    assert empty["completed"] == 0 and empty["ttft_p99_ms"] is None
    assert tally.errors == {"http_500": 1} and tally.totals["completed"] == 1
    assert tally.percentiles_between(0, 10)["requests"] == 1
    assert tally.percentiles_between(5, 10)["ttft_p50_ms"] is None


@pytest.mark.parametrize(
    "cls, name, label",
    [
        ("PrefillWorker", "tandem-prefill-0-3", "prefill-0"),
        ("DecodeWorker", "tandem-decode-1-0", "decode-1"),
        ("ClusterController", "tandem-controller", "cluster-controller"),
        ("ServeController", "SERVE_CONTROLLER_ACTOR", "serve-controller"),
        ("ProxyActor", "SERVE_PROXY_ACTOR-abc", "serve-proxy"),
        ("ServeReplica:tandem:Router", "SERVE_REPLICA::tandem#Router#x1", "router-replica"),
    ],
)
def test_process_labels(cls, name, label):
    assert process_label(cls, name) == label


def test_markdown_summary_renders_from_a_report():
    samples = run_samples()
    verdict, rss, blocks = judge(samples, LOAD_S, {"prefill-0": 0, "decode-0": 0}, 0)
    report = {
        "started": "2026-01-01T00:00:00+00:00",
        "machine": {"cpus": 2},
        "config": {"capacity_fraction": 0.8, "prefill_workers": 1, "decode_workers": 1,
                   "kv_transfer_backend": "collective", "sample_s": 5.0},
        "rule": TrendRule().describe(),
        "capacity": {"requests_per_s": 5.0},
        "plan": {"rate": 4.0, "duration_s": LOAD_S, "input_len": 128, "output_len": 64, "range_ratio": 0.25,
                 "cancel_fraction": 0.1},
        "timings_s": {"load_end": 600.0, "drained": 603.0, "settled": 604.0, "total": 700.0},
        "counts": {"sent": 10, "completed": 8, "cancelled": 1, "cancel_missed": 0, "rejected": 0, "errored": 1,
                   "hung": 0, "errors": {"http_500": 1}},
        "latency": {part: {"requests": 3, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "itl_p99_ms": 3.0,
                           "e2e_p99_ms": 4.0} for part in ("start", "middle", "end")},
        "final_blocks": {"prefill-0": 0, "decode-0": 0},
        "verdict": {"result": verdict.label, "failures": verdict.failures, "warnings": verdict.warnings},
        "rss": [j.to_json() for j in rss],
        "blocks": [j.to_json() for j in blocks],
        "samples": samples,
    }
    text = markdown(report)
    assert text.startswith("### Soak: PASS")
    assert "| driver | 200.0 |" in text and "| decode-0 |" in text and "| the middle third of the load | 3 |" in text


def test_blocks_slow_to_return_to_zero_warn():
    verdict, _, _ = judge(run_samples(), LOAD_S, {"decode-0": 0}, 0, settle_s=28.0)
    assert verdict.ok
    assert any("took 28.0 s to return to 0" in w for w in verdict.warnings), verdict.warnings
    quick, _, _ = judge(run_samples(), LOAD_S, {"decode-0": 0}, 0, settle_s=1.0)
    assert not any("to return to 0" in w for w in quick.warnings)
