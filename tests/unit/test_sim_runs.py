"""Runs of decode steps taken as one event give the simulation stepped one plan at a time:
the same token times to the last bit, the same ends, preemptions, step counts and
queue samples, disaggregated and colocated, with prefix sharing and with a pool small
enough to preempt."""

from __future__ import annotations

import pytest

from router.admission import AdmissionConfig
from sim.cost import DEVICES, CostModel, model_spec
from sim.simulator import Simulator
from sim.topology import RouterSettings, SimTopology
from sim.workload import SimRequest, generate, parse_spec

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
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_runs_give_the_stepped_simulation(case):
    topo, spec = CASES[case]
    requests = _shared_prefixes(generate(parse_spec(spec)))
    stepped = Simulator(topo, COST, requests, decode_runs=False).run()
    runs = Simulator(topo, COST, requests, decode_runs=True).run()
    for a, b in zip(stepped.records, runs.records):
        assert (list(a.token_times), a.end_s, a.error, a.cached_tokens) == (
            list(b.token_times), b.end_s, b.error, b.cached_tokens), f"request {a.index} differs with decode runs"
    assert runs.num_preemptions == stepped.num_preemptions
    assert runs.num_steps == stepped.num_steps, "a run counts each of its steps"
    assert runs.queue_samples == stepped.queue_samples
    if case == "preempting":
        assert stepped.num_preemptions > 0, "the small pool must preempt for this case to check it"
