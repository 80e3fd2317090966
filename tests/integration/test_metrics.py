"""Prometheus metrics end to end: a scrape after real traffic over HTTP and gRPC.

The session's Ray processes all write into one multiprocess folder, which is what a
node's scrape endpoint serves; each test compares scrapes before and after its load.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.helpers import PATIENCE_S, assert_blocks_freed, free_port, metric_sum, scrape, wait_for

N_HTTP, N_GRPC = 12, 4


def _delta(before, after, name, **labels):
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def test_scrape_counts_every_request_and_token(service, metrics_dir, tiny_model):
    import openai

    from protos.tandem.v1 import generate_pb2 as pb
    from protos.tandem.v1 import generate_pb2_grpc

    model = tiny_model.rstrip("/").split("/")[-1]
    before = scrape(metrics_dir)
    client = openai.AsyncOpenAI(base_url=f"{service.http_url}/v1", api_key="x", max_retries=0)

    async def http_one(i):
        kwargs = dict(model=model, prompt=f"request {i} " * (1 + i), max_tokens=3 + i, temperature=0,
                      extra_body={"ignore_eos": True})
        if i % 2:
            out = await client.completions.create(**kwargs)
            return out.usage.prompt_tokens, out.usage.completion_tokens
        stream = await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.prompt_tokens, usage.completion_tokens

    async def http_all():
        return await asyncio.gather(*(http_one(i) for i in range(N_HTTP)))

    usages = asyncio.run(http_all())
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(service.grpc_target))
    for i in range(N_GRPC):
        req = pb.GenerateRequest(text=f"grpc {i}", sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        msgs = list(stub.Generate(req))
        usages.append((msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens))
    assert_blocks_freed(service)
    n = N_HTTP + N_GRPC
    router = dict(role="router", model=model)
    generated = sum(u[1] for u in usages)

    def counted(now: dict) -> bool:
        # The router counts a request as it closes the response, just after the client
        # read it: its success first and its generated tokens last.
        return (_delta(before, now, "tandem:request_success_total", **router) >= n
                and _delta(before, now, "tandem:generation_tokens_total", **router) >= generated)

    wait_for(lambda: counted(scrape(metrics_dir)), PATIENCE_S, f"the router to count the {n} requests")
    after = scrape(metrics_dir)
    assert _delta(before, after, "tandem:request_success_total", **router) == n
    assert _delta(before, after, "tandem:request_success_total", finished_reason="length", **router) == n
    assert _delta(before, after, "tandem:time_to_first_token_seconds_count", **router) == n
    assert _delta(before, after, "tandem:e2e_request_latency_seconds_count", **router) == n
    assert _delta(before, after, "tandem:prompt_tokens_total", **router) == sum(u[0] for u in usages)
    assert _delta(before, after, "tandem:generation_tokens_total", **router) == generated
    # One gap per token after each request's first (fewer when a delta carried several);
    # gathered in memory, they are written at the latest when their request finishes.
    gaps = _delta(before, after, "tandem:inter_token_latency_seconds_count", **router)
    assert 0 < gaps <= generated - n
    # Worker-side views of the same requests.
    assert _delta(before, after, "tandem:kv_transfer_bytes_total", role="decode") > 0
    assert _delta(before, after, "tandem:request_queue_time_seconds_count", role="prefill") == n
    # At idle the gauges agree with the pools, which ``assert_blocks_freed`` saw empty
    # (this service's packed backend frees a prefill's blocks in its last step; the paged
    # hand-off, which frees them later, is tested in tests/unit/test_kv_usage_gauge.py).
    assert metric_sum(after, "tandem:kv_cache_usage_perc", role="decode", model=model) == 0.0
    assert metric_sum(after, "tandem:kv_cache_usage_perc", role="prefill", model=model) == 0.0


def test_rejections_are_counted_by_reason(service, metrics_dir, tiny_model):
    import json
    import urllib.error
    import urllib.request

    model = tiny_model.rstrip("/").split("/")[-1]
    before = scrape(metrics_dir)
    body = json.dumps({"model": model, "prompt": "x", "temperature": -1}).encode()
    req = urllib.request.Request(
        f"{service.http_url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    after = scrape(metrics_dir)
    assert _delta(before, after, "tandem:requests_rejected_total", reason="invalid_request") == 1
    assert_blocks_freed(service)


def test_preemptions_move_their_counter(default_model):
    """In-process: the engine's recorder exports preemptions by mode."""
    from engine import LLMEngine, SamplingParams
    from engine.wire.metrics import NUM_PREEMPTIONS, EngineMetrics

    engine = LLMEngine(model=str(default_model), num_kv_blocks=12, preemption_mode="recompute")
    metrics = EngineMetrics("m", "colocated", "preempt-test")
    child = NUM_PREEMPTIONS.labels("m", "colocated", "preempt-test", "recompute")
    for i in range(4):
        engine.add_request([10 + i] * 30, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.on_step(engine.stats())
    assert engine.stats().num_preemptions_recompute > 0
    assert child._value.get() == engine.stats().num_preemptions_recompute
    assert engine.stats().num_blocks_in_use == 0


def test_scrape_endpoint_keeps_vllm_style_names_whatever_the_scraper_asks_for(service):
    """Prometheus asks for OpenMetrics first; names must still read ``tandem:...``."""
    import httpx

    from cluster.metrics_server import start_metrics_server

    port = free_port()
    server = start_metrics_server(port)
    try:
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    finally:
        server.shutdown()
    assert r.status_code == 200
    names = {line.split("{")[0].split(" ")[0] for line in r.text.splitlines() if line.startswith("tandem")}
    assert "tandem:kv_cache_usage_perc" in names
    assert not [n for n in names if n.startswith("tandem_")]


def test_controller_serves_every_nodes_metrics_when_given_a_port(ray_cluster, tiny_model):
    """The RayService path: no ``tandem up``, so the controller starts one exporter per node."""
    import httpx
    import ray

    from cluster.config import ClusterConfig
    from cluster.controller import ClusterController

    port = free_port()
    config = ClusterConfig.from_dict(
        {"model": tiny_model, "prefill_workers": 0, "decode_workers": 1, "name": "node-metrics",
         "engine": {"num_kv_blocks": 64}, "restart_workers": False}
    )
    controller = ray.remote(ClusterController).options(num_cpus=0, max_concurrency=4).remote(
        config, metrics_port=port, metrics_host="127.0.0.1"
    )
    try:
        ray.get(controller.start.remote(), timeout=120)
        (address,) = ray.get(controller.metrics_addresses.remote())  # one node here
        assert address.endswith(f":{port}")
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert r.status_code == 200
        assert 'role="colocated"' in r.text and "tandem:kv_cache_usage_perc" in r.text
    finally:
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
