"""``tandem bench serve`` against a live service: a small run over HTTP (a two-rate
sweep of synthetic prompts) and one over gRPC (shared prefixes under a concurrency
cap), each checked request by request and for its JSON and plots."""

from __future__ import annotations

import json

import pytest

from bench.serve import main

pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    return {"num_kv_blocks": 256}


def run(tmp_path, tiny_model, *flags: str) -> dict:
    out = tmp_path / "result.json"
    argv = ["--model", tiny_model, "--no-progress", "--result-json", str(out), "--plot-dir", str(tmp_path / "plots"),
            "--label", "it", "--range-ratio", "0.5", "--output-len", "8", *flags]
    assert main(argv) == 0
    return json.loads(out.read_text())


def check_every_request(report: dict, runs: int, per_run: int) -> None:
    assert len(report["runs"]) == runs and report["label"] == "it"
    for run in report["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (per_run, 0), s["errors"]
        for r in run["requests"]:
            assert r["ok"], r
            assert r["output_tokens"] == r["requested_output_tokens"]
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            # A gap for each chunk after the first; a stream read slower than it is made is
            # merged into fewer chunks (``engine.async_engine.merge_outputs``), down to one.
            assert len(r["itl_s"]) <= r["output_tokens"] - 1 and r["tpot_s"] > 0
        assert any(r["itl_s"] for r in run["requests"]), "no request's tokens came in more than one chunk"
        assert s["output_throughput"] > 0 and s["ttft_ms"]["p99"] is not None


def test_http_sweep_completes_every_request_and_writes_json_and_plots(service, tiny_model, tmp_path):
    report = run(tmp_path, tiny_model, "--base-url", service.http_url, "--num-requests", "6",
                 "--input-len", "40", "--request-rate", "20,inf", "--goodput", "e2e:60000")
    check_every_request(report, runs=2, per_run=6)
    assert [run["request_rate"] for run in report["runs"]] == ["20", "inf"]
    assert report["runs"][0]["summary"]["goodput"] > 0
    for name in ("latency_cdf.png", "sweep.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def prefix_cache_hits(service) -> int:
    return sum(s["prefix_cache_hits"] for w, s in service.stats().items() if w.startswith("prefill"))


def test_grpc_shared_prefix_run_completes_every_request(service, tiny_model, tmp_path):
    hits_before = prefix_cache_hits(service)
    report = run(tmp_path, tiny_model, "--backend", "grpc", "--grpc-target", service.grpc_target,
                 "--num-requests", "12", "--max-concurrency", "4", "--workload", "shared-prefix",
                 "--num-prefix-groups", "2", "--prefix-len", "48", "--suffix-len", "8")
    check_every_request(report, runs=1, per_run=12)
    requests = report["runs"][0]["requests"]
    assert all(r["prompt_tokens"] == 56 for r in requests)
    # The prefill worker's cache served the shared prefixes (48 tokens: 3 blocks of 16).
    assert prefix_cache_hits(service) - hits_before >= 48
    assert (tmp_path / "plots" / "latency_cdf.png").is_file()
