"""The gRPC API (tandem.v1.Generation, grpc.health.v1: several choices, prompt logprobs,
abort), API-key auth and prefix affinity, on a live service.

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
from tests.helpers import assert_blocks_freed, assert_stopped_early, tokens_generated, wait_for

API_KEY = "test-key-123"
AUTH = [("authorization", f"Bearer {API_KEY}")]
MAX_REQUESTS = 4


pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    router = RouterConfig(admission=AdmissionConfig(max_requests=MAX_REQUESTS), api_key=API_KEY)
    return {"router": router, "prefill_workers": 2, "num_kv_blocks": 256}


def _request(prompt="hello world", max_tokens=8, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **sampling})
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
        (_request(n=17), grpc.StatusCode.INVALID_ARGUMENT, "n must be in [1, 16], got 17"),
        (_request(n=MAX_REQUESTS + 1), grpc.StatusCode.INVALID_ARGUMENT, "n = 5"),  # more than admission takes
        (_request(prompt_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs"),
    ]
    for request, code, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, metadata=AUTH, timeout=30))
        assert e.value.code() == code and field in e.value.details(), (request, e.value.code(), e.value.details())
    assert list(stub.Generate(_request(max_tokens=2), metadata=AUTH, timeout=30))[-1].finished


def _by_choice(messages) -> dict[int, list]:
    """The messages of a call of several choices, each choice's in order."""
    out: dict[int, list] = {}
    for m in messages:
        out.setdefault(m.index, []).append(m)
    return out


def _tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


PROMPT = [5, 17, 300, 42, 9, 1000, 77] * 3


def test_n_greedy_choices_each_give_the_single_choice_output(stub):
    single = _tokens(stub.Generate(_request(PROMPT, 12), metadata=AUTH, timeout=60))
    messages = list(stub.Generate(_request(PROMPT, 12, n=3), metadata=AUTH, timeout=60))
    choices = _by_choice(messages)
    assert sorted(choices) == [0, 1, 2], f"expected choices 0, 1, 2: {sorted(choices)}"
    for i, mine in choices.items():
        assert _tokens(mine) == single, f"greedy choice {i} differs from the n = 1 output"
        assert [m.finished for m in mine] == [False] * (len(mine) - 1) + [True], f"choice {i} must end once, last"
        assert (mine[-1].finish_reason, mine[-1].usage.completion_tokens) == ("length", 12)
    assert {m.request_id for m in messages} == {messages[0].request_id}, "every message carries the call's id"


def test_n_seeded_choices_differ_and_repeat_and_choice_i_samples_with_seed_plus_i(stub):
    def run(n, seed):
        request = _request(PROMPT, 16, n=n, temperature=0.8, seed=seed)
        return {i: _tokens(ms) for i, ms in _by_choice(stub.Generate(request, metadata=AUTH, timeout=60)).items()}

    first, again = run(3, 1234), run(3, 1234)
    assert first == again, "the same seed must give the same choices"
    assert len({tuple(t) for t in first.values()}) == 3, f"the choices should differ: {first}"
    assert run(1, 1235)[0] == first[1], "choice 1 samples as one request with seed + 1"


def test_prompt_logprobs_come_on_each_choices_first_message_and_agree_with_http(stub, http):
    messages = list(stub.Generate(_request(PROMPT, 3, n=2, prompt_logprobs=2), metadata=AUTH, timeout=60))
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2}
    reply = http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 200, reply.text
    want = reply.json()["choices"][0]["prompt_logprobs"]
    for i, mine in _by_choice(messages).items():
        assert all(not m.prompt_logprobs for m in mine[1:]), f"choice {i}: only the first message has them"
        got = mine[0].prompt_logprobs
        assert [p.token_id for p in got] == PROMPT, f"choice {i}: one entry per prompt token, in order"
        assert not got[0].HasField("logprob") and want[0] is None, "the first prompt token has no logprob"
        for k, (p, w) in enumerate(zip(got[1:], want[1:]), 1):
            expected = w[str(PROMPT[k])]
            assert abs(p.logprob - expected["logprob"]) < 1e-4 and p.rank == expected["rank"], (k, p, expected)
            assert len(p.top) == 2 and {str(t.token_id) for t in p.top} <= set(w), (k, p.top, w)


def test_abort_ends_every_choice_with_abort(service, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="abort-many", text="story " * 10,
                                            sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True, n=3)),
                         metadata=AUTH, timeout=60)
    # As soon as the call is in flight: its other choices may still wait for the first's prefill.
    wait_for(lambda: stub.Abort(pb.AbortRequest(request_id="abort-many"), metadata=AUTH, timeout=10).found,
             30, "the request to be in flight")
    choices = _by_choice(list(call))
    assert sorted(choices) == [0, 1, 2], sorted(choices)
    for i, mine in choices.items():
        ends = [m for m in mine if m.finished]
        assert [m.finish_reason for m in ends] == ["abort"] and ends[0] is mine[-1], (i, ends)
        assert mine[-1].usage.completion_tokens < 400
    assert_blocks_freed(service)


def test_a_cancelled_call_of_several_choices_stops_them_all(service, stub):
    before = tokens_generated(service)
    call = stub.Generate(_request("story " * 10, 400, n=3), metadata=AUTH, timeout=60)
    next(call)
    call.cancel()
    assert_blocks_freed(service)
    assert_stopped_early(service, before, 3 * 400)


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
