"""Replaying traces: deterministic numbers, the latencies the cost model implies, the
serving benchmark's trace format, admission, preemption and autoscaling on simulated time."""

from __future__ import annotations

import json

import pytest

from cluster.autoscaler import SLO, AutoscalingConfig, PoolBounds
from router.admission import AdmissionConfig
from sim.contention import ANY_ROLE, Contention, RoleContention
from sim.cost import DEVICES, Corrections, CostModel, decode_shape, model_spec, prefill_shape
from sim.report import parse_slo, summary
from sim.service_path import ServicePath
from sim.simulator import run
from sim.topology import RouterSettings, SimTopology
from sim.workload import SimRequest, generate, load_trace, parse_spec, write_trace

LLAMA = model_spec("llama-3.1-8b")
COST = CostModel(DEVICES["H100"], LLAMA)


def test_replaying_the_same_trace_twice_gives_the_same_percentiles():
    requests = generate(parse_spec("sharegpt:n=150,rate=30,seed=4"))
    topo = SimTopology(prefill_workers=1, decode_workers=2)
    a, b = (summary(run(topo, COST, requests), parse_slo("ttft:100,itl:20")) for _ in range(2))
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert a[key] == b[key], f"{key} differs between two replays: {a[key]} vs {b[key]}"
    assert a["completed"] == 150 and a["total_output_tokens"] == sum(r.output_tokens for r in requests)
    assert a["slo_attainment"] == b["slo_attainment"]


def test_one_colocated_request_takes_its_prefill_step_then_one_decode_step_a_token():
    cost = CostModel(DEVICES["H100"], LLAMA, Corrections(overhead_s=1e-3, mfu=0.5, mbu=0.5))
    topo = SimTopology(prefill_workers=0, decode_workers=1, engine={"enable_prefix_caching": False})
    rec = run(topo, cost, [SimRequest(0.0, 100, 5)]).records[0]
    prefill = cost.step_s(prefill_shape([100]))
    assert rec.token_times[0] == pytest.approx(prefill)
    gaps = [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
    # The k-th decode step reads the prompt and the k tokens before it.
    expected = [cost.step_s(decode_shape(1, 100 + k)) for k in range(4)]
    assert gaps == pytest.approx(expected)
    assert rec.end_s == pytest.approx(rec.token_times[-1])


def test_a_disaggregated_request_gets_its_first_token_when_its_kv_has_arrived():
    cost = CostModel(DEVICES["H100"], LLAMA, link="ib")
    rec = run(SimTopology(prefill_workers=1, decode_workers=1), cost, [SimRequest(0.0, 160, 3)]).records[0]
    blocks = 160 // 16  # every prompt block is sent: the decode worker caches none of it
    expected = cost.step_s(prefill_shape([160])) + cost.transfer_s(blocks * cost.block_bytes(16))
    assert rec.token_times[0] == pytest.approx(expected)
    assert len(rec.token_times) == 3


def test_the_requests_way_through_the_service_delays_every_token_by_that_latency():
    base = CostModel(DEVICES["H100"], LLAMA, Corrections(overhead_s=1e-3, mfu=0.5, mbu=0.5))
    late = CostModel(DEVICES["H100"], LLAMA, Corrections(overhead_s=1e-3, mfu=0.5, mbu=0.5),
                     service_path=ServicePath.fixed(0.04))
    topo = SimTopology(prefill_workers=1, decode_workers=1)
    trace = [SimRequest(0.0, 100, 5), SimRequest(1.0, 60, 3)]
    for fast, slow in zip(run(topo, base, trace).records, run(topo, late, trace).records):
        assert list(slow.token_times) == pytest.approx([t + 0.04 for t in fast.token_times])


def test_a_request_sent_with_others_in_flight_takes_a_delay_of_that_group():
    """Two colocated workers, one request each: the first is sent with none in flight (10
    ms), the second while the first runs (50 ms); a third, sent after both ended, with
    none again."""
    path = ServicePath((0, 1), ((0.010,), (0.050,)))
    cost = CostModel(DEVICES["H100"], LLAMA, Corrections(overhead_s=1e-3, mfu=0.5, mbu=0.5), service_path=path)
    topo = SimTopology(prefill_workers=0, decode_workers=2, router=RouterSettings(placement="round_robin"))
    prefill = cost.step_s(prefill_shape([100]))
    records = run(topo, cost, [SimRequest(0.0, 100, 3), SimRequest(0.001, 100, 3), SimRequest(5.0, 100, 3)]).records
    assert [r.token_times[0] - r.req.arrival_s for r in records] == pytest.approx([0.010 + prefill, 0.050 + prefill,
                                                                                 0.010 + prefill])


def test_a_call_to_a_decode_worker_mid_step_waits_for_the_step_to_end():
    """As live (``AsyncEngine.call``), a decode worker takes the reservation and the KV's
    arrival between steps: B, sent while A decodes, is reserved when A's step under way
    ends, and its first token comes at the end of the step under way as its KV lands."""
    cost = CostModel(DEVICES["H100"], LLAMA, link="ib")
    topo = SimTopology(prefill_workers=1, decode_workers=1)
    alone = run(topo, cost, [SimRequest(0.0, 160, 60)]).records[0].token_times
    sent = alone[5] + 0.3 * (alone[6] - alone[5])
    a, b = run(topo, cost, [SimRequest(0.0, 160, 60), SimRequest(sent, 160, 3)]).records
    landed = alone[6] + cost.step_s(prefill_shape([160])) + cost.transfer_s(10 * cost.block_bytes(16))
    assert b.token_times[0] == pytest.approx(min(t for t in a.token_times if t >= landed))
    assert b.token_times[0] > landed + 1e-6


def test_on_a_shared_host_a_step_begun_beside_another_workers_takes_the_contention_longer():
    """Two colocated workers, two requests at once: the first prefill begins alone, the other
    beside it and takes 2.5 times as long; each worker's next step begins while the other's
    runs; the second request's last step begins alone and takes its own time."""
    corrections = Corrections(overhead_s=1e-3, mfu=0.5, mbu=0.5)
    alone = CostModel(DEVICES["H100"], LLAMA, corrections)
    shared = CostModel(DEVICES["H100"], LLAMA, corrections,
                       contention=Contention({ANY_ROLE: RoleContention((1.0, 2.5), (0.0, 0.0))}))
    topo = SimTopology(prefill_workers=0, decode_workers=2, router=RouterSettings(placement="round_robin"))
    first, second = run(topo, shared, [SimRequest(0.0, 100, 2), SimRequest(0.0, 100, 3)]).records
    assert first.decode is not second.decode
    prefill, decode = alone.step_s(prefill_shape([100])), alone.step_s(decode_shape(1, 100))
    assert 1.5 * prefill < 2.5 * decode  # the first's decode step still runs when the second's prefill ends
    assert list(first.token_times) == pytest.approx([prefill, prefill + 2.5 * decode])
    assert list(second.token_times) == pytest.approx(
        [2.5 * prefill, 2.5 * prefill + 2.5 * decode, 2.5 * prefill + 2.5 * decode + alone.step_s(decode_shape(1, 101))])


def test_on_a_shared_host_a_step_begun_with_more_requests_in_flight_takes_longer():
    """One worker; the service's work on the shared cores adds a step's own time for each
    request in flight past one: A alone takes its own time; B, sent with C, takes twice its
    prefill's (the worker begins it as B arrives, with both in flight)."""
    corrections = Corrections(overhead_s=1e-3, mfu=0.5, mbu=0.5)
    alone = CostModel(DEVICES["H100"], LLAMA, corrections)
    per_request = RoleContention((1.0,), (1.0,), per_request=1.0)
    shared = CostModel(DEVICES["H100"], LLAMA, corrections, contention=Contention({"decode": per_request}))
    topo = SimTopology(prefill_workers=0, decode_workers=1, engine={"enable_prefix_caching": False})
    a, b, _ = run(topo, shared, [SimRequest(0.0, 100, 2), SimRequest(5.0, 100, 2), SimRequest(5.0, 100, 2)]).records
    prefill = alone.step_s(prefill_shape([100]))
    assert list(a.token_times) == pytest.approx([prefill, prefill + alone.step_s(decode_shape(1, 100))])
    assert b.token_times[0] == pytest.approx(5.0 + 2 * prefill)


def test_a_bench_serve_result_replays_as_its_requests_were_sent(tmp_path):
    records = [{"sent_s": 0.5 * i, "prompt_tokens": 50 + i, "requested_output_tokens": 8, "index": i}
               for i in range(6)]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"runs": [{"request_rate": "2", "requests": records}]}))
    requests = load_trace(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (0.5 * i, 50 + i, 8) for i in range(6)]
    s = summary(run(SimTopology(), COST, requests))
    assert s["completed"] == 6 and s["total_output_tokens"] == 48


def test_a_json_lines_trace_round_trips(tmp_path):
    requests = generate(parse_spec("synthetic:n=20,in=64,out=16,range=0.5,rate=10,seed=2"))
    write_trace(tmp_path / "t.jsonl", requests)
    assert load_trace(tmp_path / "t.jsonl") == requests


def test_admission_rejects_what_is_over_its_bound():
    router = RouterSettings(admission=AdmissionConfig(max_requests=4))
    requests = [SimRequest(0.0, 100, 50) for _ in range(10)]
    s = summary(run(SimTopology(router=router), COST, requests))
    assert s["completed"] == 4 and s["errors"] == {"http_429": 6}


def test_a_small_kv_pool_preempts_and_still_finishes_every_request():
    topo = SimTopology(prefill_workers=0, decode_workers=1, engine={"num_kv_blocks": 40, "swap_space": 0})
    requests = [SimRequest(0.0, 100, 120) for _ in range(6)]
    s = summary(run(topo, COST, requests))
    assert s["completed"] == 6
    assert s["num_preemptions"] > 0, "six requests growing to 14 blocks each cannot share 39 blocks without preemption"


def test_shared_prefixes_hit_the_prefix_cache_of_the_worker_they_are_placed_on():
    requests = [SimRequest(0.01 * i, 600, 4, prefix_group=0, prefix_len=512) for i in range(8)]
    s = summary(run(SimTopology(prefill_workers=0, decode_workers=2), COST, requests))
    # The first request computes the prefix; affinity sends the rest where it is cached.
    assert s["cached_prompt_tokens"] >= 7 * 512


def test_autoscaling_adds_decode_workers_under_load_and_counts_them():
    scaling = AutoscalingConfig(prefill=PoolBounds(1, 2), decode=PoolBounds(1, 4), slo=SLO(ttft_ms=500, itl_ms=8),
                                interval_s=2.0, scale_down_delay_s=10.0)
    topo = SimTopology(prefill_workers=1, decode_workers=1, autoscaling=scaling, worker_start_s=5.0,
                       router=RouterSettings(admission=AdmissionConfig(max_requests=10**6)))
    result = run(topo, COST, generate(parse_spec("sharegpt:n=1500,rate=40,seed=1")))
    adds = [d for _, d in result.scaling_decisions if d.action == "add" and d.role == "decode"]
    assert adds, f"an ITL SLO of 8 ms under load should add decode workers: {result.scaling_decisions}"
    assert result.num_devices_max > 2


def _one_h100(**engine) -> SimTopology:
    unbounded = RouterSettings(admission=AdmissionConfig(max_requests=10**9, max_prompt_tokens=10**12))
    return SimTopology(prefill_workers=0, decode_workers=1, router=unbounded, engine={"max_num_seqs": 64, **engine})


def test_continuous_batching_outserves_static_batching_on_a_simulated_h100():
    requests = generate(parse_spec("sharegpt:n=200,seed=5"))  # all at once: throughput
    static = summary(run(_one_h100(batching="static", enable_chunked_prefill=False, max_num_batched_tokens=8192),
                         COST, requests))
    continuous = summary(run(_one_h100(enable_chunked_prefill=False, max_num_batched_tokens=8192), COST, requests))
    ratio = continuous["output_throughput"] / static["output_throughput"]
    assert ratio > 1.5, f"continuous batching should keep the batch full: {ratio:.2f}x static"


def test_chunked_prefill_keeps_long_prompts_from_stalling_token_gaps():
    requests = generate(parse_spec("long-mix:n=150,in=161,out=200,range=0.5,long=0.1,long_len=6000,rate=12,seed=3"))
    whole = summary(run(_one_h100(enable_chunked_prefill=False, max_num_batched_tokens=8192), COST, requests))
    chunked = summary(run(_one_h100(max_num_batched_tokens=512), COST, requests))
    assert chunked["itl_ms"]["p99"] < whole["itl_ms"]["p99"], (
        f"ITL p99 {chunked['itl_ms']['p99']:.1f} ms chunked vs {whole['itl_ms']['p99']:.1f} ms unchunked")


def test_a_live_run_replayed_on_its_own_topology_compares_each_metric(tmp_path):
    """``bench.sim live-validate``'s replay: a ``bench.serve`` result whose measured summary is
    the simulation's own comes back with no error on any metric."""
    from bench.sim import replay_live
    from sim.fitting import cost_model

    cost = cost_model("cpu", model_spec("tandem-tiny-llama"))
    requests = [SimRequest(0.25 * i, 96 + i, 12) for i in range(8)]
    topo = SimTopology(prefill_workers=1, decode_workers=2, engine={"num_kv_blocks": 256})
    simulated = summary(run(topo, cost, requests))
    records = [{"sent_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "requested_output_tokens": r.output_tokens}
               for r in requests]
    path = tmp_path / "live-1P+2D.json"
    path.write_text(json.dumps({"runs": [{"request_rate": "4", "summary": simulated, "requests": records}]}))
    [row] = replay_live("1P+2D", path, cost, 256)
    assert row["rate"] == "4" and row["topology"] == "1P+2D"
    errors = {name: m["error"] for name, m in row["metrics"].items()}
    assert errors == dict.fromkeys(errors, 0.0), f"the same trace on the same topology must agree exactly: {errors}"


def test_each_live_step_counts_the_other_workers_mid_step_as_it_began():
    from bench.sim import others_busy

    def steps(*spans_ms):
        return [{"start_s": start / 1e3, "step_ms": length} for start, length in spans_ms]

    a = steps((0, 10), (20, 10), (40, 5))
    b = steps((5, 20), (41, 3))
    c = steps((6, 1), (30, 2))
    # a's first began alone, its second while b's first ran (5-25), its third alone (b's
    # second began after it); b's first began beside a's; c's first beside a's and b's.
    assert others_busy([a, b, c]) == [[0, 1, 0], [1, 1], [2, 0]]


def test_blocks_placed_on_a_decode_worker_count_as_pending_until_its_step_ends():
    """B and C come while both decode workers are mid-step: B goes to the one with more
    free blocks, and its reservation waits there; C sees those blocks as pending (as the
    dispatcher counts them) and goes to the other."""
    cost = CostModel(DEVICES["H100"], LLAMA)
    topo = SimTopology(prefill_workers=1, decode_workers=2, engine={"num_kv_blocks": 64})
    trace = [SimRequest(0.0, 480, 400), SimRequest(0.0001, 16, 400), SimRequest(1.0, 480, 3),
             SimRequest(1.0001, 16, 3)]
    long, short, b, c = run(topo, cost, trace).records
    assert long.decode is not short.decode
    assert b.decode is short.decode  # 62 blocks free there, 33 on the other
    assert c.decode is long.decode  # 62 less B's 31 pending


def test_requests_in_flight_on_the_hosts_clock_count_those_sent_and_not_ended():
    from bench.sim import requests_in_flight

    run = {"started_monotonic_s": 100.0, "requests": [
        {"sent_s": 0.0, "e2e_s": 1.0}, {"sent_s": 0.5, "e2e_s": 2.0}, {"sent_s": 0.6, "e2e_s": None}]}  # failed
    at = requests_in_flight(run)
    assert [at(t) for t in (99.9, 100.0, 100.55, 100.6, 101.0, 102.4, 102.5)] == [0, 1, 2, 2, 1, 1, 0]
