"""The OpenAI-compatible HTTP API against a live service on a local Ray.

One service (1 prefill + 1 decode worker on the tiny model, admission bound of 64
requests) for the whole module. Every test ends with no KV blocks in use anywhere.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

try:  # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

from router.admission import AdmissionConfig
from router.server import RouterConfig
from tests.helpers import assert_blocks_freed, assert_stopped_early, tokens_generated

MAX_REQUESTS = 64
MAX_BODY = 64 * 1024

pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    return {"router": RouterConfig(admission=AdmissionConfig(max_requests=MAX_REQUESTS), max_body_bytes=MAX_BODY)}


@pytest.fixture(scope="module")
def model_name(tiny_model):
    from pathlib import Path

    return Path(tiny_model).name


@pytest.fixture
def client(service):
    import openai

    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_names_the_served_model_and_health_is_ok(service, client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    r = httpx.get(f"{service.http_url}/health")
    assert r.status_code == 200, r.text


def test_greedy_completions_equal_the_single_engine(service, client, tiny_model, model_name):
    from engine import LLM, SamplingParams

    rng = random.Random(1)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(6)]
    lengths = [rng.randint(4, 24) for _ in prompts]
    llm = LLM(model=tiny_model, num_kv_blocks=256)
    want = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    for prompt, n, ref in zip(prompts, lengths, want):
        got = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
        )
        text = got.choices[0].text
        assert text == ref.text, f"prompt {prompt!r}: HTTP {text!r} != engine {ref.text!r}"
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == ref.num_prompt_tokens
        assert got.usage.completion_tokens == n
        assert got.usage.total_tokens == ref.num_prompt_tokens + n


def test_chat_streaming_gives_the_same_text_as_non_streaming_plus_usage(client, model_name):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about cats."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0

    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason], finishes
    assert not chunks[-1].choices and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_streamed_completion_carries_logprobs_and_seeded_sampling_repeats(client, model_name):
    stream = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7,
        logprobs=2, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    tops = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
    assert len(tokens) >= 7 and all(len(t) >= 1 for t in tops), (tokens, tops)
    assert chunks[-1].usage.completion_tokens == 8
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    again = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].text == text, "the same seed must give the same sample"


def test_every_generated_token_has_a_logprob_including_the_first(client, model_name):
    out = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices[0].logprobs.tokens) == 4, out.choices[0].logprobs


def test_bad_requests_get_openai_errors_naming_the_field(service, client, model_name):
    import openai

    cases = [
        (dict(temperature=-1), openai.BadRequestError, "temperature"),
        (dict(top_p=1.5), openai.BadRequestError, "top_p"),
        (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
        (dict(n=17), openai.BadRequestError, "n"),
        (dict(prompt="word " * 600), openai.BadRequestError, "prompt"),
        (dict(max_tokens=10_000), openai.BadRequestError, "max_tokens"),
        (dict(model="no-such-model"), openai.NotFoundError, "model"),
        (dict(extra_body={"temperature": "hot"}), openai.BadRequestError, "temperature"),
    ]
    for overrides, error, param in cases:
        kwargs = {"model": model_name, "prompt": "hello", "max_tokens": 4, **overrides}
        with pytest.raises(error) as e:
            client.completions.create(**kwargs)
        body = e.value.body
        assert body["param"] == param and param in body["message"], (overrides, body)

    url = f"{service.http_url}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
    r = httpx.post(url, json={"model": model_name, "prompt": "x" * (MAX_BODY + 1)})
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"], r.text
    r = httpx.post(f"{service.http_url}/v1/chat/completions", json={"model": model_name, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text

    ok = client.completions.create(model=model_name, prompt="still serving", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_64_concurrent_streams_complete_with_correct_usage(client, model_name, tiny_model):
    import openai

    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_model)
    rng = random.Random(64)
    prompts = [f"request {i}: " + "lorem ipsum " * rng.randint(1, 30) for i in range(64)]
    lengths = [rng.randint(4, 24) for _ in prompts]
    aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120)

    async def one(prompt, n):
        stream = await aclient.completions.create(
            model=model_name, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
        return text, usage, finish

    async def main():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    for prompt, n, (_text, usage, finish) in zip(prompts, lengths, results):
        assert finish == "length" and usage is not None, (finish, usage)
        assert usage.completion_tokens == n, f"{usage.completion_tokens} != max_tokens {n}"
        assert usage.prompt_tokens == len(tok.encode(prompt))
    print(f"64 streams in {elapsed:.1f}s")


def test_a_burst_past_the_admission_bound_gets_429s_and_the_admitted_complete(service, model_name):
    url = f"{service.http_url}/v1/completions"
    body = {"model": model_name, "prompt": "burst " * 20, "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(http.post(url, json=body) for _ in range(3 * MAX_REQUESTS)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code == 429]
    admitted = [r for r in responses if r.status_code == 200]
    assert len(rejected) + len(admitted) == len(responses), f"unexpected statuses {sorted(set(codes))}"
    assert rejected, "a burst of 3x the bound must see 429s"
    assert len(admitted) >= MAX_REQUESTS // 2, f"only {len(admitted)} admitted"
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    for r in admitted:
        assert r.json()["usage"]["completion_tokens"] == 48


def test_a_client_that_disconnects_stops_its_request_and_frees_its_blocks_on_both_workers(service, model_name):
    body = {
        "model": model_name, "prompt": "a long story " * 10, "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }
    before = tokens_generated(service)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{service.http_url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert events and "text_completion" in events[0]
            in_use = service.blocks_in_use()
            assert any(v > 0 for v in in_use.values()), f"the request should hold blocks: {in_use}"
    waited = assert_blocks_freed(service)
    assert_stopped_early(service, before, body["max_tokens"])
    print(f"blocks freed {waited:.3f}s after the disconnect")
