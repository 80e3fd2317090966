"""The simulator against the live cluster, CI-sized: a short ``bench.serve`` run on a live
1P+1D service (the default model, tandem-tiny-llama), its own trace replayed strictly by
the CPU-calibrated simulation of the same topology and KV block counts, and the two
compared.

The full table (four topologies at two loads, the issue's 10% / 15% bounds) is
``python -m bench.sim live-validate`` (docs/SIMULATOR.md). Here the bounds are what a
2-core machine that other work shares allows without flaking: below saturation both
sides must serve the arrival rate (throughput within 25%), and the latencies must be
within the same order of magnitude with the simulation the faster side (simulated /
measured between 0.05 and 1.5 for TTFT p50 and the TPOT and E2E means). The simulation
models the engines' steps on an uncontended core each; the live service adds the
ingress, the router, Ray calls, the KV transfer's own costs and, on 2 cores, every
process's contention with the others (one run at a load average of 4: 0.14, 0.31 and
0.25).
"""

from __future__ import annotations

import json

import pytest

from bench.serve import main as serve
from bench.sim import compare
from sim.cost import cost_model, model_spec
from sim.report import summary
from sim.simulator import run
from sim.topology import SimTopology
from sim.workload import load_trace
from tests.helpers import running_service

NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def service(ray_cluster, default_model):
    with running_service(str(default_model), prefill_workers=1, decode_workers=1, num_kv_blocks=NUM_KV_BLOCKS) as svc:
        yield svc


def test_a_short_live_run_and_its_strict_replay_agree_within_loose_bounds(service, default_model, tmp_path):
    path = tmp_path / "run.json"
    argv = ["--base-url", service.http_url, "--model", str(default_model), "--no-progress", "--result-json",
            str(path), "--workload", "synthetic", "--input-len", "96", "--output-len", "16", "--range-ratio", "0.5",
            "--num-requests", "16", "--request-rate", "4", "--seed", "3"]
    assert serve(argv) == 0
    measured = json.loads(path.read_text())["runs"][0]["summary"]
    assert (measured["completed"], measured["failed"]) == (16, 0), measured["errors"]

    topo = SimTopology(prefill_workers=1, decode_workers=1, engine={"num_kv_blocks": NUM_KV_BLOCKS})
    simulated = summary(run(topo, cost_model("cpu", model_spec("tandem-tiny-llama")), load_trace(path)))
    assert simulated["completed"] == 16
    row = compare(measured, simulated)
    error = row["throughput_tok_s"]["error"]
    assert abs(error) <= 0.25, f"throughput: simulated / measured - 1 = {error:+.0%}, expected within 25%: {row}"
    for name in ("ttft_p50_ms", "tpot_mean_ms", "e2e_mean_ms"):
        ratio = row[name]["simulated"] / row[name]["measured"]
        assert 0.05 <= ratio <= 1.5, f"{name}: simulated / measured = {ratio:.2f}, expected in [0.05, 1.5]: {row}"
