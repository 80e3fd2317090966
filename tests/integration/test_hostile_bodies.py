"""Hostile bodies of up to a megabyte against a live service, beside a running stream
(issue 53).

One service (1 prefill + 1 decode worker on the tiny model, the router's defaults: the
1 MiB body limit) for the module. While completions stream one after another, the test
sends (a) the schema bomb beside a small structured request, (b) 110k stop strings with
n 16 (0.55 MB), (c) ``guided_json`` as JSON text nested 100000 deep (0.2 MB) and (d) four
chat bodies of 1 MB at once. Each hostile body must get its 400 within its bound while
the small request completes with valid JSON, and the stream must never wait more than
``MAX_GAP_S`` between two events (measured here, at the client): refusing them costs
the router's event loop nothing. The measured times are printed (``-s``). The smaller
hostile bodies are drawn by the fuzzers (tests/fuzz, under a 64 KiB limit).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

try:  # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

from tests.helpers import PATIENCE_S, async_wait_for

pytestmark = pytest.mark.usefixtures("no_blocks_left")

MAX_GAP_S = 1.5  # between two events of the stream; measured: tens of milliseconds
BOMB_S = 10.0  # the schema bomb's answer (unbounded, its parse took 36 s)
BIG_S = 5.0  # each other hostile body's answer (measured: a fraction of a second)
STREAM = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
BOMB = {"prompt": "hi", "max_tokens": 1, "guided_json": {"type": "string", "pattern": "[a-z]{1,20000}"}}
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False}
SMALL = {"prompt": "Give me JSON:", "max_tokens": 20, "guided_json": SMALL_SCHEMA}
STOPS = {"prompt": "hi", "max_tokens": 1, "stop": ["x"] * 110_000, "n": 16}
NESTED = {"prompt": "hi", "max_tokens": 1, "guided_json": "[" * 100_000 + "]" * 100_000}
MEGABYTE_CHAT = {"messages": [{"role": "user", "content": "x" * 1_036_000}], "max_tokens": 1}


class Streams:
    """Streamed completions, one after another until ``done`` is set, and the time of each
    SSE event they bring (the next stream's first event counts from the last one's end)."""

    def __init__(self, client) -> None:
        self.client = client
        self.done = asyncio.Event()
        self.times: list[float] = []
        self.count = 0

    async def run(self) -> None:
        while not self.done.is_set():
            async with self.client.stream("POST", "/v1/completions", json=STREAM) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        self.times.append(time.monotonic())
            self.count += 1

    def largest_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


async def timed_post(client, path: str, raw: bytes, within_s: float = BIG_S):
    """(the response, seconds it took) of POSTing ``raw`` as JSON; fails past ``within_s``."""
    start = time.monotonic()
    try:
        r = await asyncio.wait_for(client.post(path, content=raw, headers={"content-type": "application/json"}),
                                   within_s)
    except TimeoutError:
        pytest.fail(f"{path} ({len(raw):,} bytes): no answer within {within_s}s")
    return r, time.monotonic() - start


def assert_refused(r, took: float, within_s: float, param: str, says: str) -> None:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert took < within_s, f"{param}: answered in {took:.2f}s, over {within_s}s"


async def hostile_beside_a_stream(url: str) -> None:
    """The four phases while ``Streams`` run; prints what each measured."""
    bodies = {name: json.dumps(b).encode() for name, b in
              {"bomb": BOMB, "small": SMALL, "stops": STOPS, "nested": NESTED, "chat": MEGABYTE_CHAT}.items()}
    async with httpx.AsyncClient(base_url=url, timeout=PATIENCE_S) as client:
        streams = Streams(client)
        running = asyncio.create_task(streams.run())
        await async_wait_for(lambda: streams.times or running.done(), PATIENCE_S, "the stream's first event")

        (bomb, bomb_s), (small, small_s) = await asyncio.gather(
            timed_post(client, "/v1/completions", bodies["bomb"], BOMB_S),
            timed_post(client, "/v1/completions", bodies["small"], PATIENCE_S))
        assert_refused(bomb, bomb_s, BOMB_S, "guided_json", "(max_regex_size)")
        assert small.status_code == 200, small.text
        choice = small.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and set(json.loads(choice["text"])) == {"ok"}, choice
        print(f"\n(a) the schema bomb: 400 in {bomb_s:.3f}s; the small structured request beside it: 200 in {small_s:.3f}s")

        r, took = await timed_post(client, "/v1/completions", bodies["stops"])
        assert_refused(r, took, BIG_S, "stop", "stop has 110000 strings, over the limit of 16")
        print(f"(b) 110000 stop strings, n 16 ({len(bodies['stops']):,} bytes): 400 in {took:.3f}s")

        r, took = await timed_post(client, "/v1/completions", bodies["nested"])
        assert_refused(r, took, BIG_S, "guided_json", "nested too deeply")
        print(f"(c) guided_json nested 100000 deep ({len(bodies['nested']):,} bytes): 400 in {took:.3f}s")

        answers = await asyncio.gather(*(timed_post(client, "/v1/chat/completions", bodies["chat"]) for _ in range(4)))
        for r, took in answers:
            assert_refused(r, took, BIG_S, "messages", "characters")
        print(f"(d) four chat bodies of {len(bodies['chat']):,} bytes at once: 400 in "
              + ", ".join(f"{took:.3f}s" for _, took in answers))

        streams.done.set()
        await running
    gap = streams.largest_gap()
    print(f"the streams ({streams.count}, {len(streams.times)} events): the largest gap between events {gap:.3f}s")
    assert gap < MAX_GAP_S, f"the stream waited {gap:.2f}s between two events, over {MAX_GAP_S}s"


def test_hostile_bodies_are_refused_in_time_while_a_stream_flows(service):
    asyncio.run(hostile_beside_a_stream(service.http_url))
