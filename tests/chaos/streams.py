"""What the chaos modules share: a streaming greedy load on a live service, and its verdict.

A workload is ``(prompts, lengths, want)``: the prompts, each one's ``max_tokens``, and
the undisturbed single engine's greedy text for each (``reference``). ``run_load`` sends
the first ``count`` of them as streaming completions, ``concurrency`` at a time, while a
``chaos(progress)`` coroutine breaks things beside them; ``judge`` then asserts that:

- every request ended within ``DEADLINE_S`` (none hangs), with its full result or a clear
  error; a stream never ends cleanly with other text than the reference (a re-run or a
  moved stream included) or short of it (silent truncation);
- a request failed only where the scenario allows it: after tokens had reached its client
  (``may_fail``: it cannot be re-run then), or with an error the scenario excuses;
- afterwards every worker (survivors and replacements) holds no KV blocks, and the
  service answers a normal request.

``judge`` prints one line (sent, completed, errored, hung, blocks leaked); ``pytest -s``
shows them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
import ray

from kv_transfer.nixl import unavailable_reason
from tests.helpers import PATIENCE_S, async_wait_for, running_service

NEEDS_NIXL = pytest.mark.skipif(unavailable_reason() is not None, reason=f"nixl unavailable: {unavailable_reason()}")
ALL_BACKENDS = ["object_store", "collective", pytest.param("nixl", marks=NEEDS_NIXL)]


def backends(ci: str) -> list:
    """The transfer backends a scenario runs on: every one under ``scripts/chaos``
    (``TANDEM_CHAOS_ALL_BACKENDS=1``), else ``ci`` alone. Scenarios about one backend's
    own way of failing (a worker killed mid-transfer) take ``ALL_BACKENDS`` always."""
    return ALL_BACKENDS if os.environ.get("TANDEM_CHAOS_ALL_BACKENDS") else [ci]
DEADLINE_S = 120.0  # per request: past this it counts as hung
CLIENT_RETRIES = 2


@dataclass
class Outcome:
    index: int
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    chunks: int = 0  # chunks with text that reached the client
    hung: bool = False
    done: bool = False
    retries: int = 0  # client retries (before any token)


def reference(model: str, prompts: list[str], lengths: list[int]) -> tuple[list[str], list[int], list[str]]:
    """The workload of ``prompts`` with the undisturbed greedy texts of one offline engine."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, num_kv_blocks=512)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    assert llm.stats().num_blocks_in_use == 0
    return prompts, lengths, [o.text for o in outs]


def model_name(model: str) -> str:
    return model.rstrip("/").split("/")[-1]


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, out: Outcome, prompt: str, n: int, deadline_s: float = DEADLINE_S,
) -> Outcome:
    """One streaming greedy completion, filling ``out`` as its chunks arrive; hung past ``deadline_s``."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}

    async def read() -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.done = True
                    return
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"].get("message") or str(event["error"])
                    continue
                choice = event["choices"][0]
                if choice.get("text"):
                    out.text += choice["text"]
                    out.chunks += 1
                out.finish_reason = choice.get("finish_reason") or out.finish_reason

    async def attempts() -> None:
        # Like the openai client: a 5xx or a broken connection before any token is retried.
        for attempt in range(1 + CLIENT_RETRIES):
            out.error = None
            try:
                await read()
            except httpx.HTTPError as e:  # the connection broke: the client sees that, nothing silent
                out.error = f"{type(e).__name__}: {e}"
            retryable = out.error is not None and out.chunks == 0 and not out.error.startswith("HTTP 4")
            if not retryable or attempt == CLIENT_RETRIES:
                return
            out.retries += 1
            await asyncio.sleep(0.5 * 2**attempt)

    try:
        await asyncio.wait_for(attempts(), deadline_s)
    except asyncio.TimeoutError:
        out.hung = True
    return out


async def run_load(url: str, model: str, workload, chaos, count: int | None, concurrency: int) -> list[Outcome]:
    """Run the workload's first ``count`` requests ``concurrency`` at a time while
    ``chaos(progress)`` runs beside them. With ``count`` None, its prompts go round and
    round until the chaos is done, then those in flight finish: a chaos that waits for
    the service to reach some state never runs out of load first (on a slow machine it
    did). Each outcome's index is its prompt's. ``progress``: "finished" (a count),
    "outcomes" (those finished) and "live" (request number -> the Outcome of each
    request in flight, filled as its chunks arrive)."""
    prompts, lengths, _ = workload
    progress = {"finished": 0, "outcomes": [], "live": {}}
    sent = itertools.count()

    async def worker(client):
        while True:
            n = next(sent)
            if chaos_task.done() if count is None else n >= count:
                return
            o = progress["live"][n] = Outcome(n % len(prompts))
            await one_stream(client, url, model, o, prompts[o.index], lengths[o.index])
            del progress["live"][n]
            progress["outcomes"].append(o)
            progress["finished"] += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(DEADLINE_S, connect=10)) as client:
        chaos_task = asyncio.create_task(chaos(progress))
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        await chaos_task
    return sorted(progress["outcomes"], key=lambda o: o.index)


def difference(o: Outcome, want: str) -> str:
    """Where a request's text left the reference, for the failure message."""
    at = next((i for i, (a, b) in enumerate(zip(o.text, want)) if a != b), min(len(o.text), len(want)))
    return (f"request {o.index} ({o.chunks} chunks, finish {o.finish_reason}, {o.retries} retries) differs at "
            f"char {at}: got {o.text[max(0, at - 20):at + 40]!r}, want {want[max(0, at - 20):at + 40]!r} "
            f"({len(o.text)} vs {len(want)} chars)")


def judge(name: str, outcomes: list[Outcome], workload, svc, may_fail: bool, count: int,
          excused: Callable[[Outcome], bool] = lambda o: False) -> None:
    """The verdict on a scenario (see the module docstring); ``excused``: errors the
    scenario allows whenever they come (e.g. past a re-run bound)."""
    _, _, want = workload
    hung = [o.index for o in outcomes if o.hung]
    truncated = [o.index for o in outcomes if not o.hung and o.error is None and (o.text != want[o.index] or o.finish_reason != "length")]
    errored = [o for o in outcomes if o.error is not None]
    completed = len(outcomes) - len(errored) - len(hung)
    leaked = blocks_after(svc)
    retried = sum(o.retries > 0 for o in outcomes)
    print(f"\nchaos[{name}]: sent {len(outcomes)}, completed {completed}, errored {len(errored)}, "
          f"hung {len(hung)}, blocks leaked {leaked}, retried by the client {retried}")
    assert len(outcomes) == count
    assert not hung, f"requests hung: {hung}"
    assert not truncated, "ended without error but not the reference text: " + "; ".join(
        difference(o, want[o.index]) for o in outcomes if o.index in truncated
    )
    for o in errored:
        assert o.error.strip(), f"request {o.index}: an error without a message"
        if excused(o):
            continue
        assert may_fail, f"request {o.index} failed where it could have been re-run: {o.error}"
        assert o.chunks > 0, f"request {o.index} failed before any token reached it (re-runnable): {o.error}"
    assert leaked == 0, f"{leaked} KV blocks still in use: {holders(svc)}"
    assert_serves(svc)


def holders(svc) -> dict:
    """Per worker holding blocks: what its engine and hand-off records hold (for a failure message)."""
    keys = ("num_blocks_in_use", "num_running", "num_waiting", "num_swapped", "handoffs", "held")
    return {wid: {k: s[k] for k in keys if k in s} for wid, s in svc.stats().items() if s["num_blocks_in_use"]}


def blocks_after(svc, within_s: float = 60.0) -> int:
    """Blocks in use on every live worker once things settle (0 unless leaked)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            used = sum(svc.blocks_in_use().values())
        except ray.exceptions.RayError:  # a worker is being replaced
            used = -1
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def assert_serves(svc) -> None:
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(f"{svc.http_url}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def services_fixture(settings: dict, deadlines: dict):
    """A module's ``services`` fixture: one ``Services`` of these settings, closed at the end."""

    @pytest.fixture(scope="module")
    def services(ray_cluster, tiny_model):
        s = Services(tiny_model, settings, deadlines)
        yield s
        s.close()

    return services


def workers(svc) -> tuple[list, list]:
    """The service's (prefill, decode) ``WorkerRef``s, as the controller lists them now."""
    return ray.get(svc.controller.workers.remote())


async def until(predicate, what: str) -> None:
    """Poll the async ``predicate`` (every 20 ms) until it holds."""
    await async_wait_for(predicate, PATIENCE_S, what, every_s=0.02)


async def kill(handle) -> None:
    await asyncio.to_thread(ray.kill, handle, no_restart=True)


class Services:
    """One live service at a time (Serve holds one ``tandem`` app), one per transfer
    backend: asking for another backend shuts the current one down first. Each scenario
    sets the transfer faults it wants (none by default) on the running workers.

    ``settings``: ``running_service``'s keywords for every service; ``deadlines``: the
    transfer settings every backend gets."""

    def __init__(self, model: str, settings: dict, deadlines: dict) -> None:
        self.model = model
        self.settings = settings
        self.deadlines = deadlines
        self._backend: str | None = None
        self._ctx = None
        self._svc = None

    def get(self, backend: str = "object_store", **transfer):
        from kv_transfer.config import TransferConfig

        if backend != self._backend:
            self.close()
            self._ctx = running_service(self.model, **self.settings, transfer={"backend": backend, **self.deadlines})
            self._svc, self._backend = self._ctx.__enter__(), backend
        config = TransferConfig.from_dict({"backend": backend, **self.deadlines, **transfer})
        ray.get(self._svc.controller.set_transfer.remote(config))
        return self._svc

    def close(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx, self._backend = self._ctx, None, None
            ctx.__exit__(None, None, None)
