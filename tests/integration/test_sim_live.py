"""The simulator against the live cluster, CI-sized: a short ``bench.serve`` run on a live
1P+1D service (the default model, tandem-tiny-llama), its own trace replayed strictly by
the simulation of the same topology and KV block counts, and the two compared.

The simulation's costs are timed inside the live workers first (``bench.sim``'s
``live_profile``: a calibration run of its own, every worker recording its steps' shapes
and times, their role, how many other workers were mid-step and how many requests were
in flight as each began, since on this machine the workers and the service share two
cores), with the request's way through the service (ingress, router, Ray calls) as the
delays measured, by requests in flight (``with_service_path``). The full table (four
topologies at two loads, the issue's 10% / 15% bounds) is ``python -m bench.sim
live-validate --live-profile``
(docs/SIMULATOR.md). Here the bounds are what 16 requests on a 2-core machine allow
without flaking: throughput within 25%, and simulated / measured between 0.5 and 2 for
TTFT p50 and the TPOT and E2E means (the shipped profile, timed on an engine alone, gave
0.14 to 0.31 here).
"""

from __future__ import annotations

import argparse
import json

import pytest

from bench.serve import main as serve
from bench.sim import compare, live_profile, with_service_path
from sim.cost import model_spec
from sim.fitting import cost_model
from sim.report import summary
from sim.service_path import ServicePath
from sim.simulator import run
from sim.topology import SimTopology
from sim.workload import load_trace
from tests.helpers import running_service

NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def service(ray_cluster, default_model):
    with running_service(str(default_model), prefill_workers=1, decode_workers=1, num_kv_blocks=NUM_KV_BLOCKS) as svc:
        yield svc


def test_a_short_live_run_and_its_strict_replay_on_costs_timed_in_the_live_workers_agree(
        service, default_model, tmp_path):
    workload = argparse.Namespace(input_len=96, output_len=16, range_ratio=0.5, requests=16, model=str(default_model),
                                  seed=3, calibration_rate="4", calibration_requests=16, num_kv_blocks=NUM_KV_BLOCKS)
    profile = live_profile(service, "1P+1D", workload, tmp_path)
    with_service_path("1P+1D", profile, tmp_path / "calibration-1P+1D.json", NUM_KV_BLOCKS)
    table = json.loads(profile.read_text())
    prefills = [r for r in table["rows"] if r["prefill_tokens"]]
    assert len(prefills) >= 8 and len(table["rows"]) > len(prefills)  # both workers' steps, timed
    assert all(r["step_ms"] > 0 and r["others_busy"] in (0, 1) and 0 <= r["in_flight"] <= 16 for r in table["rows"])
    assert {r["role"] for r in prefills} >= {"prefill"} and {r["role"] for r in table["rows"]} == {"prefill", "decode"}
    delays = [d for g in ServicePath.from_json(table["service_path"]).groups for d in g]
    assert len(delays) == 16 and all(0.0 <= d < 1.0 for d in delays)  # one a request, in seconds

    path = tmp_path / "run.json"
    argv = ["--base-url", service.http_url, "--model", str(default_model), "--no-progress", "--result-json",
            str(path), "--workload", "synthetic", "--input-len", "96", "--output-len", "16", "--range-ratio", "0.5",
            "--num-requests", "16", "--request-rate", "4", "--seed", "3"]
    assert serve(argv) == 0
    measured = json.loads(path.read_text())["runs"][0]["summary"]
    assert (measured["completed"], measured["failed"]) == (16, 0), measured["errors"]

    topo = SimTopology(prefill_workers=1, decode_workers=1, engine={"num_kv_blocks": NUM_KV_BLOCKS})
    simulated = summary(run(topo, cost_model("cpu", model_spec("tandem-tiny-llama"), profile), load_trace(path)))
    assert simulated["completed"] == 16
    row = compare(measured, simulated)
    error = row["throughput_tok_s"]["error"]
    assert abs(error) <= 0.25, f"throughput: simulated / measured - 1 = {error:+.0%}, expected within 25%: {row}"
    for name in ("ttft_p50_ms", "tpot_mean_ms", "e2e_mean_ms"):
        ratio = row[name]["simulated"] / row[name]["measured"]
        assert 0.5 <= ratio <= 2.0, f"{name}: simulated / measured = {ratio:.2f}, expected in [0.5, 2]: {row}"
