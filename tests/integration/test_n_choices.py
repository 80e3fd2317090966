"""``n`` > 1 through the live service: several choices of one prompt in one response.

The module runs twice: colocated (one decode worker runs whole requests) and
disaggregated (1 prefill + 1 decode worker). Each test sends a few requests and ends
with no KV blocks in use anywhere.

What it pins down: greedy choices equal the n = 1 output; with a seed s, choice i is
the n = 1 output with seed s + i (vLLM's rule), so the whole response is reproducible;
a stream of n choices interleaves complete choices and ends with [DONE]; the prompt is
prefilled once (the prefix-cache counters of the worker that prefills show the other
choices' full prompt blocks came from the cache), and disaggregated, its full blocks are
sent once (the decode worker holds them for the other choices).
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from tests.helpers import assert_blocks_freed

pytestmark = pytest.mark.usefixtures("no_blocks_left")

TOPOLOGIES = {"colocated": {"prefill_workers": 0, "decode_workers": 1},
              "1P1D": {"prefill_workers": 1, "decode_workers": 1}}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def service_settings(request):
    return TOPOLOGIES[request.param]


def _texts(response) -> list[str]:
    assert [c.index for c in response.choices] == list(range(len(response.choices))), response
    return [c.text for c in response.choices]


def _prompt(seed: int, length: int = 45) -> list[int]:
    """A prompt of token ids that no other test sends (so nothing of it is cached yet)."""
    return random.Random(seed).sample(range(10, 900), length)


def test_greedy_choices_are_equal_and_equal_the_single_choice(client, model_name):
    common = dict(model=model_name, prompt="The quick brown fox", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    (single,) = _texts(client.completions.create(**common))
    out = client.completions.create(**common, n=3)
    assert _texts(out) == [single] * 3, out
    assert out.usage.prompt_tokens == client.completions.create(**common).usage.prompt_tokens, \
        "the prompt's tokens count once"
    assert out.usage.completion_tokens == 3 * 8, out.usage
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = dict(model=model_name, messages=messages, max_tokens=6, temperature=0)
    one = client.chat.completions.create(**chat).choices[0].message.content
    two = client.chat.completions.create(**chat, n=2)
    assert [c.index for c in two.choices] == [0, 1] and [c.message.content for c in two.choices] == [one, one]


def test_seeded_choice_i_is_the_single_choice_with_seed_s_plus_i(client, model_name):
    common = dict(model=model_name, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                  extra_body={"ignore_eos": True})
    singles = [_texts(client.completions.create(**common, seed=100 + i))[0] for i in range(3)]
    first = _texts(client.completions.create(**common, seed=100, n=3))
    assert first == singles, (first, singles)
    assert _texts(client.completions.create(**common, seed=100, n=3)) == first, "the response must be reproducible"
    # prompts × n: choice index = prompt_index * n + i
    two = _texts(client.completions.create(**{**common, "prompt": ["Once upon a time", "Hello"]}, seed=100, n=2))
    assert two[:2] == singles[:2], two


def _events(http, path: str, body: dict) -> list:
    events = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streams_interleave_complete_choices_and_end_with_done(http, client, model_name):
    body = dict(model=model_name, prompt="It was a dark", max_tokens=6, temperature=0, ignore_eos=True, n=2)
    whole = [r["text"] for r in http.post("/v1/completions", json=body).json()["choices"]]
    events = _events(http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if e["choices"]]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == whole, (texts, whole)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert reasons == ["length", "length"], reasons
    assert events[-2]["usage"]["completion_tokens"] == 12, events[-2]

    chat = dict(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                ignore_eos=True, n=2, stream=True)
    events = _events(http, "/v1/chat/completions", chat)
    assert events[-1] == "[DONE]"
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for e in events[:-1]:
        (choice,) = e["choices"]
        by_index[choice["index"]].append(choice)
    for i, choices in by_index.items():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}, f"choice {i} must open with its role"
        assert choices[-1]["finish_reason"] == "length", choices[-1]
    contents = ["".join(c["delta"].get("content", "") for c in by_index[i]) for i in (0, 1)]
    assert contents[0] == contents[1] and contents[0], contents


def test_a_client_gone_mid_stream_aborts_every_choice(service, http, model_name):
    def generated() -> int:
        return sum(s["generation_tokens"] for s in service.stats().values())

    before, n, max_tokens = generated(), 3, 400
    body = dict(model=model_name, prompt="Far away", max_tokens=max_tokens, ignore_eos=True, n=n, stream=True)
    seen = set()
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[len("data: "):])["choices"][0]["index"])
            if len(seen) == n:
                in_use = service.blocks_in_use()
                assert any(in_use.values()), f"the choices should hold blocks while they stream: {in_use}"
                break  # every choice is streaming: leave
    assert_blocks_freed(service)  # every choice's blocks come back...
    assert generated() - before < n * max_tokens, "...because the choices were stopped, not run out"


def _kv_bytes_received(service) -> int:
    return sum(s["transfer"]["bytes_received"] for wid, s in service.stats().items() if wid.startswith("decode"))


def test_the_prompt_s_full_blocks_are_sent_once(service, client, model_name):
    if not service.config.cluster.prefill_workers:
        pytest.skip("colocated: no KV is sent")
    block_size = ray.get(service.controller.dispatch_settings.remote())["block_size"]
    common = dict(model=model_name, max_tokens=2, extra_body={"ignore_eos": True})
    before = _kv_bytes_received(service)
    client.completions.create(prompt=_prompt(seed=11), **common)
    one = _kv_bytes_received(service) - before  # a prompt nothing of which was cached
    blocks, held = -(-45 // block_size), 44 // block_size
    before = _kv_bytes_received(service)
    n = 6
    assert len(client.completions.create(prompt=_prompt(seed=12), n=n, **common).choices) == n
    sent = (_kv_bytes_received(service) - before) * blocks // one
    assert held and sent == blocks + (n - 1) * (blocks - held), (
        f"{n} choices of a {blocks}-block prompt: {sent} blocks sent, not {blocks} once and then "
        f"{blocks - held} per other choice")


def _prefix_counters(service, role: str) -> tuple[int, int]:
    stats = [s for wid, s in service.stats().items() if wid.startswith(role)]
    return sum(s["prefix_cache_queries"] for s in stats), sum(s["prefix_cache_hits"] for s in stats)


def _busy(client, model_name, running: threading.Event) -> str:
    """A long request streamed alongside, so the worker is mid-step when choices arrive
    (requests that arrive in one step are let in together, before any is cached)."""
    stream = client.completions.create(model=model_name, prompt=_prompt(seed=8, length=300), max_tokens=120,
                                       stream=True, extra_body={"ignore_eos": True})
    text = ""
    for chunk in stream:
        running.set()
        text += chunk.choices[0].text if chunk.choices else ""
    return text


def test_the_prompt_is_prefilled_once_and_the_other_choices_hit_the_cache(service, client, model_name):
    role = "prefill" if service.config.cluster.prefill_workers else "colocated"  # the workers that prefill
    block_size = ray.get(service.controller.dispatch_settings.remote())["block_size"]
    prompt, n = _prompt(seed=7), 8
    running = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(_busy, client, model_name, running)
        assert running.wait(60), "the long request never started streaming"
        queries_before, hits_before = _prefix_counters(service, role)
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, n=n, seed=3,
                                        extra_body={"ignore_eos": True})
        queries, hits = (a - b for a, b in zip(_prefix_counters(service, role), (queries_before, hits_before)))
        busy.result()
    cacheable = (len(prompt) - 1) // block_size * block_size  # full blocks, one token left to compute
    assert len(out.choices) == n and cacheable >= block_size
    assert hits >= (n - 1) * cacheable, (
        f"the {n - 1} other choices should each find {cacheable} of the prompt's {len(prompt)} tokens cached; "
        f"{hits} of {queries} tokens looked up hit the cache")
    assert queries - hits <= len(prompt) + (n - 1) * (len(prompt) - cacheable), \
        f"more than one full prefill: {queries - hits} prompt tokens computed"


def test_bad_n_is_a_400_naming_it(http, model_name):
    for body, param in [({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
                        ({"n": 16, "prompt": ["a", "b", "c", "d", "e"]}, "n")]:
        r = http.post("/v1/completions", json={"model": model_name, "prompt": "hi", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
