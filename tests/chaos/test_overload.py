"""Overload: bursts of 10x the admission bound, over HTTP and gRPC, on a live service.

One service for the module (1 prefill + 1 decode worker, tiny model) whose router
admits at most ``K`` requests at a time. Each burst sends ``10 * K`` streaming
requests at once. The excess must be turned away fast and with a hint (HTTP 429 with
``Retry-After``; gRPC RESOURCE_EXHAUSTED with "retry after Ns" in the details: Ray
Serve drops trailing metadata on errors, so the hint cannot travel there), every
admitted request must stream its full output, and the resident memory of the router
replica, the Serve proxy and both workers must not keep growing from burst to burst.
Every test ends with no KV blocks in use. The figures (admitted, rejected, rejection
latency, RSS per process) are printed (``-s``) and written to ``overload.json`` in the
session's temp folder.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

import grpc
import psutil
import pytest

try:  # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

from protos.tandem.v1 import generate_pb2 as pb
from protos.tandem.v1 import generate_pb2_grpc
from router.admission import AdmissionConfig
from router.server import RouterConfig
from tests.helpers import write_report

K = 8  # the admission bound (max outstanding requests)
BURST = 10 * K
MAX_TOKENS = 24
MIB = 1 << 20
# RSS growth allowed per process over 6 bursts, once both transports have been warmed up.
# Measured on the tiny model (2 CPUs): +1 to +21 MiB per process, the most in the prefill
# worker, whose oneDNN projections keep memory per row-count bucket they first meet
# (engine.model.model.packed_rows); before row counts were bucketed it grew 30-48 MiB.
RSS_GROWTH_BOUND = 48 * MIB
REJECTION_P99_BOUND_S = 10.0  # generous: the 2-CPU machine also runs the admitted requests (measured: < 3 s)
# Rejected at least: HTTP requests arrive within a few ms, so all but about K are turned
# away; Serve's gRPC proxy lets them in over a second or more, during which admitted
# ones finish and make room for later ones (8 to 37 admitted of 80 measured).
MIN_REJECTED = {"http": BURST // 2, "grpc": BURST // 4}

FIGURES: dict = {"bursts": [], "rss_mib": []}


@dataclass
class Outcome:
    transport: str
    status: str  # "200" / "429" / gRPC code name
    latency_s: float
    retry_after_s: int | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    detail: str = ""


pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    return {"router": RouterConfig(admission=AdmissionConfig(max_requests=K)), "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def processes(service):
    """name -> psutil.Process: the router replica, the Serve proxy, the workers."""
    import ray

    procs = {}
    prefill, decode = ray.get(service.controller.workers.remote())
    for ref in prefill + decode:
        procs[ref.worker_id] = psutil.Process(ray.get(ref.handle.ready.remote())["pid"])
    # Ray's processes descend from this driver (it started the local Ray); Serve's
    # actors show their class in the process title.
    for child in psutil.Process().children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "ServeReplica:tandem:Router" in title:
            procs["router"] = child
        elif "ProxyActor" in title:
            procs["serve-proxy"] = child
    assert {"router", "serve-proxy"} <= procs.keys(), f"found only {sorted(procs)}"
    return procs


@pytest.fixture(scope="module", autouse=True)
def report(tmp_path_factory):
    yield
    path = write_report(tmp_path_factory, "overload.json", FIGURES)
    print(f"\noverload figures ({path}):")
    for b in FIGURES["bursts"]:
        print(f"  burst {b['name']}: {b['admitted']} admitted, {b['rejected']} rejected, rejection latency "
              f"p50 {b['rejection_p50_s']:.3f}s p99 {b['rejection_p99_s']:.3f}s, retry-after {b['retry_after_s']}, "
              f"admitted done in {b['admitted_max_s']:.2f}s")
    for sample in FIGURES["rss_mib"]:
        print(f"  RSS after {sample['after']}: {sample['rss']}")


def _prompt(i: int) -> str:
    return f"request {i}: " + "the quick brown fox " * (1 + i % 5)


def _p(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- one burst per transport -----------------------------------------------------------


async def _http_one(client: httpx.AsyncClient, i: int) -> Outcome:
    body = {
        "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "server_busy", error
            retry = r.headers.get("retry-after")
            return Outcome("http", str(r.status_code), time.perf_counter() - t0,
                           int(retry) if retry is not None else None, detail=error["message"])
        text, usage, finish = "", None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    return Outcome("http", "200", time.perf_counter() - t0, None, usage["completion_tokens"], finish, text)


async def _grpc_one(stub, i: int) -> Outcome:
    request = pb.GenerateRequest(
        text=_prompt(i), sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    t0 = time.perf_counter()
    call = stub.Generate(request, timeout=120)
    try:
        messages = [m async for m in call]
    except grpc.aio.AioRpcError as e:
        match = re.search(r"retry after (\d+)s", e.details() or "")
        metadata = dict(e.trailing_metadata() or ())
        retry = int(match.group(1)) if match else None
        if "retry-after" in metadata:  # if Serve ever passes trailing metadata on errors
            retry = int(metadata["retry-after"])
        return Outcome("grpc", e.code().name, time.perf_counter() - t0, retry, detail=e.details())
    last = messages[-1]
    text = "".join(m.text for m in messages)
    return Outcome("grpc", "OK", time.perf_counter() - t0, None, last.usage.completion_tokens,
                   last.finish_reason if last.finished else None, text)


async def _burst(service, transport: str, offset: int) -> list[Outcome]:
    if transport == "http":
        limits = httpx.Limits(max_connections=BURST + 8, max_keepalive_connections=BURST + 8)
        async with httpx.AsyncClient(base_url=service.http_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_http_one(client, offset + i) for i in range(BURST)))
    async with grpc.aio.insecure_channel(service.grpc_target) as channel:
        await channel.channel_ready()
        stub = generate_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(_grpc_one(stub, offset + i) for i in range(BURST)))


def run_burst(service, transport: str, name: str, offset: int = 0) -> list[Outcome]:
    outcomes = asyncio.run(_burst(service, transport, offset))
    ok, busy = ("200", "429") if transport == "http" else ("OK", "RESOURCE_EXHAUSTED")
    admitted = [o for o in outcomes if o.status == ok]
    rejected = [o for o in outcomes if o.status == busy]
    others = [o for o in outcomes if o.status not in (ok, busy)]
    FIGURES["bursts"].append({
        "name": name, "admitted": len(admitted), "rejected": len(rejected), "other": len(others),
        "rejection_p50_s": _p([o.latency_s for o in rejected], 0.5),
        "rejection_p99_s": _p([o.latency_s for o in rejected], 0.99),
        "retry_after_s": sorted({o.retry_after_s for o in rejected}),
        "admitted_max_s": max((o.latency_s for o in admitted), default=0.0),
    })
    assert not others, f"unexpected outcomes: {[(o.status, o.detail) for o in others[:5]]}"
    assert len(admitted) >= K, f"only {len(admitted)} of {BURST} admitted with room for {K}"
    assert len(rejected) >= MIN_REJECTED[transport], f"only {len(rejected)} of {BURST} rejected past a bound of {K}"
    for o in rejected:
        assert o.retry_after_s is not None and o.retry_after_s >= 1, (o.status, o.detail)
    for o in admitted:
        assert o.finish_reason == "length" and o.completion_tokens == MAX_TOKENS, o
        assert o.text, o
    assert _p([o.latency_s for o in rejected], 0.99) < REJECTION_P99_BOUND_S, FIGURES["bursts"][-1]
    return outcomes


def sample_rss(processes: dict, after: str) -> dict[str, float]:
    rss = {name: round(p.memory_info().rss / MIB, 1) for name, p in sorted(processes.items())}
    FIGURES["rss_mib"].append({"after": after, "rss": rss})
    return rss


# -- the tests -----------------------------------------------------------------


def test_http_bursts_get_429_with_retry_after_and_the_admitted_stream_in_full(service, processes):
    with httpx.Client(base_url=service.http_url, timeout=60) as http:  # warm up the path
        assert http.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2}).status_code == 200
    sample_rss(processes, "warm-up")
    for n in range(2):
        run_burst(service, "http", f"http-{n + 1}", offset=n * BURST)
    sample_rss(processes, "2 HTTP bursts")


def test_grpc_bursts_get_resource_exhausted_with_a_retry_hint_and_the_admitted_stream_in_full(service, processes):
    for n in range(2):
        run_burst(service, "grpc", f"grpc-{n + 1}", offset=n * BURST)
    sample_rss(processes, "2 gRPC bursts")


def test_memory_stays_bounded_over_repeated_bursts(service, processes):
    # The baseline: both transports warmed up (the proxy's first gRPC burst costs it a
    # one-time ~200 MiB, flat afterwards).
    if FIGURES["rss_mib"] and FIGURES["rss_mib"][-1]["after"] == "2 gRPC bursts":
        first = FIGURES["rss_mib"][-1]["rss"]
    else:  # run alone
        run_burst(service, "http", "http-warm-up", offset=10 * BURST)
        run_burst(service, "grpc", "grpc-warm-up", offset=10 * BURST)
        first = sample_rss(processes, "a burst of each")
    for n in range(3):
        run_burst(service, "http", f"http-{n + 3}", offset=(n + 2) * BURST)
        run_burst(service, "grpc", f"grpc-{n + 3}", offset=(n + 2) * BURST)
    last = sample_rss(processes, "3 more HTTP + gRPC bursts")
    growth = {name: last[name] - first[name] for name in last}
    FIGURES["rss_growth_mib"] = growth
    assert all(g * MIB <= RSS_GROWTH_BOUND for g in growth.values()), (
        f"RSS grew by more than {RSS_GROWTH_BOUND // MIB} MiB: {growth}"
    )
    # and the service is healthy and idle again: a normal request gets in and finishes
    with httpx.Client(base_url=service.http_url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "after the storm", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
