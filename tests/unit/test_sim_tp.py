"""Tensor parallelism in the simulator and the planner (``sim.cost``, ``sim.planner``): a worker of
t ranks is t devices, each with 1/t of the weights and of the KV heads, its steps paying the
collectives the sharded forward makes; a hand-off between sizes moves each rank's share over
its own link; the planner searches each role's size among those the model splits over and fits.
"""

from __future__ import annotations

import pytest

from sim.cost import MODELS, ModelSpec, StepShape, decode_shape, prefill_shape
from sim.fitting import cost_model
from sim.planner import Candidate, PlanSettings, candidates, fitting_sizes, plan
from sim.report import SloTarget
from sim.simulator import run
from sim.topology import SimTopology
from sim.workload import WorkloadSpec, generate

LLAMA_8B, LLAMA_70B = MODELS["llama-3.1-8b"], MODELS["llama-3.1-70b"]


def test_a_rank_does_half_the_work_and_pays_the_collectives():
    one = cost_model("H100", LLAMA_8B)
    two = one.at_tp(2)
    assert one.at_tp(2) is two and two.at_tp(1) is one, "one model a size"
    assert one.collective_s(64, 64) == 0.0 < two.collective_s(1, 1) < two.collective_s(4096, 1)
    for shape in (decode_shape(1, 1024), decode_shape(64, 2048), prefill_shape([4096])):
        t1, t2 = one.step_s(shape), two.step_s(shape)
        assert t1 / 2 < t2 < t1, f"{shape}: TP 2 {t2 * 1e3:.2f} ms against TP 1 {t1 * 1e3:.2f} ms"
        assert two.roofline_s(shape) == pytest.approx(one.roofline_s(shape) / 2)


def test_a_run_of_decode_steps_costs_each_step_what_step_s_does_at_any_size():
    two = cost_model("H100", LLAMA_8B).at_tp(2)
    batch, context = 16, 3000
    steps = two.decode_steps_s(batch, context, 5)
    kv = [context + batch * j for j in range(1, 6)]  # what the j-th step reads
    assert list(steps) == [two.step_s(StepShape(batch, batch, 0, n, n, batch)) for n in kv]


def test_kv_blocks_are_a_ranks_memory_over_its_share_of_a_block():
    one = cost_model("H100", LLAMA_8B)
    assert one.at_tp(2).kv_blocks_fitting(16) > 2 * one.kv_blocks_fitting(16), "half the weights, half the heads"
    two_kv_heads = ModelSpec("two-kv-heads", 4, 1024, 8, 2, 128, 4096, 32000)  # at 4 ranks each head twice
    four = cost_model("H100", two_kv_heads).at_tp(4)
    assert four.rank_block_bytes(16) == four.block_bytes(16) / 2


def test_a_model_bigger_than_a_device_fits_only_split():
    one = cost_model("H100", LLAMA_70B)
    with pytest.raises(ValueError, match="does not fit one H100"):
        one.kv_blocks_fitting(16)
    assert fitting_sizes(one, 16) == (2, 4, 8)
    with pytest.raises(ValueError, match=r"attention heads \(9\) do not divide by tensor_parallel_size 2"):
        cost_model("H100", MODELS["smollm2-135m"]).at_tp(2)


def test_a_handoff_between_sizes_takes_as_long_as_the_rank_with_the_largest_share():
    cost = cost_model("H100", LLAMA_8B)
    whole = cost.handoff_busy_s(100, 16, 1, 1)
    assert whole == pytest.approx(100 * cost.block_bytes(16) / cost.link_bw)
    assert cost.handoff_busy_s(100, 16, 2, 1) == cost.handoff_busy_s(100, 16, 1, 2) == whole
    assert cost.handoff_busy_s(100, 16, 2, 2) == pytest.approx(whole / 2)
    assert cost.handoff_busy_s(100, 16, 4, 2) == pytest.approx(whole / 2)


def test_a_tp2_decode_pool_holds_two_devices_a_worker_and_serves_with_shorter_gaps():
    cost = cost_model("H100", LLAMA_8B)
    requests = generate(WorkloadSpec(kind="synthetic", n=200, rate=20.0, input_len=2048, output_len=128, seed=1))
    results = {}
    for tp in (1, 2):
        topo = SimTopology(prefill_workers=1, decode_workers=1, decode_engine={"tensor_parallel_size": tp})
        assert topo.num_devices == 1 + tp
        result = run(topo, cost, requests)
        assert result.num_devices_max == 1 + tp
        assert all(r.end_s is not None and r.error is None for r in result.records)
        gaps = [b - a for r in result.records for a, b in zip(r.token_times, r.token_times[1:])]
        results[tp] = sorted(gaps)[len(gaps) // 2]
    assert results[2] < results[1], f"median gap TP 2 {results[2] * 1e3:.2f} ms, TP 1 {results[1] * 1e3:.2f} ms"


def test_the_candidates_use_a_units_devices_whole_at_every_size():
    cands = candidates(4, PlanSettings(chunks=(512,), batch_caps=(64,)), (1, 2))
    pools = {(c.prefill_workers, c.decode_workers, c.prefill_tp, c.decode_tp) for c in cands}
    assert all(c.num_devices == 4 for c in cands)
    assert pools == {(1, 3, 1, 1), (2, 2, 1, 1), (3, 1, 1, 1), (1, 1, 2, 2), (2, 1, 1, 2), (1, 2, 2, 1),
                     (0, 4, 1, 1), (0, 2, 1, 2)}
    topo = Candidate(1, 2, 512, 64, prefill_tp=2).topology(SimTopology())
    assert topo.prefill_engine["tensor_parallel_size"] == 2 and topo.num_devices == 4
    assert "tp 2/1" in Candidate(1, 2, 512, 64, prefill_tp=2).label()


def test_the_planner_splits_a_model_bigger_than_a_device():
    cost = cost_model("H100", LLAMA_70B)
    spec = WorkloadSpec(kind="synthetic", n=50, rate=1.0, input_len=1024, output_len=64, seed=0)
    settings = PlanSettings(chunks=(2048,), batch_caps=(64,), iters=1, trial_s=5.0, warmup_s=5.0, min_requests=10)
    result = plan(4, SimTopology(), cost, spec, SloTarget(ttft_ms=2000, itl_ms=200), settings, verify=False)
    assert result.ranked, "some deployment serves it"
    for ev in result.evaluated:
        c = ev.candidate
        assert c.decode_tp == 2 and (c.colocated or c.prefill_tp == 2), "the smallest size it fits: two H100s"
        assert c.num_devices == 4
