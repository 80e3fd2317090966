"""The gRPC API (tandem.v1.Generation, grpc.health.v1), API-key auth and prefix
affinity, on a live service.

One service for the module (2 prefill + 1 decode workers, an API key, a small
admission bound of 4 requests); the client is built from the committed stubs. Every
test ends with no KV blocks in use anywhere.
"""

from __future__ import annotations

import concurrent.futures
import re

import grpc
import pytest

from protos.grpc.health.v1 import health_pb2, health_pb2_grpc
from protos.tandem.v1 import generate_pb2 as pb
from router.admission import AdmissionConfig
from router.server import RouterConfig
from tests.helpers import assert_blocks_freed, assert_stopped_early, tokens_generated

API_KEY = "test-key-123"
AUTH = [("authorization", f"Bearer {API_KEY}")]
MAX_REQUESTS = 4


pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    router = RouterConfig(admission=AdmissionConfig(max_requests=MAX_REQUESTS), api_key=API_KEY)
    return {"router": router, "prefill_workers": 2, "num_kv_blocks": 256}


def _request(prompt="hello world", n=8, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(**{"max_tokens": n, "temperature": 0.0, "ignore_eos": True, **sampling})
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling=params)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)


def test_standard_health_check_says_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=60)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_model_info_needs_the_api_key(stub, tiny_model):
    from pathlib import Path

    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "Bearer wrong")], timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
    assert info.name == Path(tiny_model).name and info.max_model_len == 512 and info.decode_workers == 1


def test_http_needs_the_api_key_but_health_does_not(service):
    import openai

    try:
        import httpx2 as httpx
    except ImportError:
        import httpx

    assert httpx.get(f"{service.http_url}/health").status_code == 200
    bad = openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{service.http_url}/v1", api_key=API_KEY, max_retries=0)
    assert len(good.models.list().data) == 1


def test_streaming_generate_gives_the_single_engine_tokens(stub, tiny_model):
    from engine import LLM, SamplingParams

    prompt = [5, 17, 300, 42, 9, 1000, 77] * 5
    (want,) = LLM(model=tiny_model, num_kv_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    messages = list(stub.Generate(_request(prompt, 20), metadata=AUTH, timeout=60))
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == want.token_ids
    last = messages[-1]
    assert last.finished and last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 20)
    assert not any(m.finished for m in messages[:-1])


def test_invalid_requests_get_invalid_argument_or_not_found_naming_the_field(stub):
    cases = [
        (_request(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (_request(top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (_request("word " * 600), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (pb.GenerateRequest(text="hi", model="no-such-model"), grpc.StatusCode.NOT_FOUND, "model"),
    ]
    for request, code, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, metadata=AUTH, timeout=30))
        assert e.value.code() == code and field in e.value.details(), (request, e.value.code(), e.value.details())
    assert list(stub.Generate(_request(n=2), metadata=AUTH, timeout=30))[-1].finished


def test_abort_ends_the_stream_and_frees_blocks_on_both_workers(service, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="abort-me", text="story " * 10,
                                            sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True)),
                         metadata=AUTH, timeout=60)
    first = next(call)
    assert first.request_id == "abort-me" and not first.finished
    assert stub.Abort(pb.AbortRequest(request_id="abort-me"), metadata=AUTH, timeout=10).found
    rest = list(call)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort", rest[-1:]
    waited = assert_blocks_freed(service)
    print(f"blocks freed {waited:.3f}s after Abort")


def test_a_cancelled_call_stops_its_request_and_frees_blocks_on_both_workers(service, stub):
    before = tokens_generated(service)
    call = stub.Generate(_request("story " * 10, 400), metadata=AUTH, timeout=60)
    next(call)
    assert any(v > 0 for v in service.blocks_in_use().values())
    call.cancel()
    waited = assert_blocks_freed(service)
    assert_stopped_early(service, before, 400)
    print(f"blocks freed {waited:.3f}s after cancel")


def test_a_burst_past_the_bound_gets_resource_exhausted_and_the_rest_complete(stub):
    def one(i):
        try:
            msgs = list(stub.Generate(_request(f"burst {i} " * 5, 32), metadata=AUTH, timeout=60))
            return msgs[-1].usage.completion_tokens
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert re.search(r"retry after \d+s", e.details()), e.details()
            return e.code()

    with concurrent.futures.ThreadPoolExecutor(4 * MAX_REQUESTS) as pool:
        results = list(pool.map(one, range(4 * MAX_REQUESTS)))
    rejected = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
    completed = [r for r in results if r == 32]
    assert rejected and completed and len(rejected) + len(completed) == len(results), results


def test_requests_sharing_a_prefix_go_to_the_prefill_worker_that_cached_it(service, stub):
    def hits():
        return {w: s["prefix_cache_hits"] for w, s in service.stats().items() if w.startswith("prefill")}

    before = hits()
    prefix = [(7 * i) % 900 + 3 for i in range(64)]  # four full blocks
    for i in range(6):
        list(stub.Generate(_request(prefix + [1000 + i, 5], 2), metadata=AUTH, timeout=30))
    gained = {w: hits()[w] - before[w] for w in before}
    assert sorted(gained.values()) == [0, 5 * 64], f"expected one worker to serve the prefix from cache: {gained}"
