"""Runs of decode steps taken as one event give the simulation stepped one plan at a time:
the same token times to the last bit, the same ends, preemptions, step counts, queue
samples and autoscaling decisions, disaggregated and colocated, with prefix sharing, with
a pool small enough to preempt and with pools the controller resizes."""

from __future__ import annotations

import pytest

from cluster.autoscaler import SLO, AutoscalingConfig, PoolBounds
from router.admission import AdmissionConfig
from sim.cost import DEVICES, CostModel, model_spec
from sim.simulator import Simulator
from sim.topology import RouterSettings, SimTopology
from sim.workload import RateProfile, SimRequest, generate, generate_profile, parse_spec

COST = CostModel(DEVICES["H100"], model_spec("llama-3.1-8b"))
UNBOUNDED = RouterSettings(admission=AdmissionConfig(max_requests=10**9, max_prompt_tokens=10**12))


def _shared_prefixes(requests: list[SimRequest]) -> list[SimRequest]:
    """Every third request shares a 64-token prefix with others of its group."""
    return [SimRequest(r.arrival_s, r.prompt_tokens, r.output_tokens, i % 4 if i % 3 == 0 else -1, 64)
            for i, r in enumerate(requests)]


CASES = {
    "disaggregated": (SimTopology(prefill_workers=2, decode_workers=3, router=UNBOUNDED),
                      "sharegpt:n=300,rate=60,seed=3"),
    "colocated": (SimTopology(prefill_workers=0, decode_workers=3, router=UNBOUNDED),
                  "sharegpt:n=300,rate=40,seed=5"),
    # 600 blocks of 16 tokens: requests are preempted and swapped.
    "preempting": (SimTopology(prefill_workers=1, decode_workers=2, engine={"num_kv_blocks": 600},
                               router=UNBOUNDED), "sharegpt:n=200,rate=80,seed=7"),
    "local prefills": (SimTopology(prefill_workers=1, decode_workers=2,
                                   router=RouterSettings(admission=UNBOUNDED.admission, local_prefill_tokens=96)),
                       "sharegpt:n=200,rate=50,seed=9"),
    # The controller reads the pools every second, adds workers under load and drains them after.
    "autoscaling": (SimTopology(prefill_workers=1, decode_workers=1, worker_start_s=2.0, router=UNBOUNDED,
                                autoscaling=AutoscalingConfig(prefill=PoolBounds(1, 2), decode=PoolBounds(1, 3),
                                                              slo=SLO(ttft_ms=100, itl_ms=12), interval_s=1.0,
                                                              scale_down_delay_s=3.0, low_water=0.8)),
                    ("sharegpt:seed=11", RateProfile(((6.0, 60.0, 60.0), (12.0, 3.0, 3.0))))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_runs_give_the_stepped_simulation(case):
    topo, spec = CASES[case]
    if isinstance(spec, tuple):  # busy, then quiet: the pools grow, then shrink
        requests = _shared_prefixes(generate_profile(parse_spec(spec[0]), spec[1]))
    else:
        requests = _shared_prefixes(generate(parse_spec(spec)))
    stepped = Simulator(topo, COST, requests, decode_runs=False).run()
    runs = Simulator(topo, COST, requests, decode_runs=True).run()
    for a, b in zip(stepped.records, runs.records):
        assert (list(a.token_times), a.end_s, a.error, a.cached_tokens) == (
            list(b.token_times), b.end_s, b.error, b.cached_tokens), f"request {a.index} differs with decode runs"
    assert runs.num_preemptions == stepped.num_preemptions
    assert runs.num_steps == stepped.num_steps, "a run counts each of its steps"
    assert runs.queue_samples == stepped.queue_samples
    assert runs.scaling_decisions == stepped.scaling_decisions and runs.device_s == stepped.device_s
    if case == "autoscaling":
        actions = {d.action for _, d in stepped.scaling_decisions}
        assert {"add", "remove"} <= actions, "the pools must grow and shrink for this case to check it"
    if case == "preempting":
        assert stepped.num_preemptions > 0, "the small pool must preempt for this case to check it"


def test_a_run_may_start_with_a_prompts_last_token_and_the_window_counts_it_as_a_first_token():
    """A chunk that ends one token short of the prompt leaves a 1-token step, which a run
    takes as a decode step: with autoscaling, its token reaches the latency window as the
    request's first (a TTFT), as stepping gives it."""
    topo = SimTopology(prefill_workers=0, decode_workers=1, router=UNBOUNDED, engine={"max_num_batched_tokens": 64},
                       autoscaling=AutoscalingConfig(decode=PoolBounds(1, 1), interval_s=0.05))
    # The first decodes from the second step on; the second's 64-token prompt then gets 63 of
    # the 64-token budget, and its last token rides in the next step, a decode step.
    requests = [SimRequest(0.0, 10, 200), SimRequest(0.001, 64, 100)]
    stepped = Simulator(topo, COST, requests, decode_runs=False)
    stepped_result = stepped.run()
    runs = Simulator(topo, COST, requests, decode_runs=True)
    runs_result = runs.run()
    for a, b in zip(stepped_result.records, runs_result.records):
        assert list(a.token_times) == list(b.token_times)
    assert runs.latency.report(runs.now) == stepped.latency.report(stepped.now)
