"""Chaos: workers, transfers and the router fail under a steady streaming load.

A live service with 2 prefill and 2 decode workers serves N streaming greedy
completions per scenario, CONCURRENCY at a time, while one thing breaks. A service runs
per transfer backend; each scenario sets its transfer faults on the running workers.
Every scenario asserts:

- every request ends within a deadline (none hangs), with its full result or a clear
  error; a stream never ends cleanly with fewer tokens than asked (silent truncation);
- a completed request's text equals the undisturbed single engine's, re-run or not;
- a request fails only if the failure came after tokens had reached its client (it
  cannot be re-run then); before that, the router re-runs it on other workers. When the
  router replica itself dies, its open streams break off (an incomplete chunked body,
  an error for the client), and requests with no answer yet get HTTP 500 from Serve's
  Python proxy, or a closed connection from HAProxy (the default ingress); the client
  retries either before any token, as the openai client does (2 retries);
- afterwards every worker (survivors and replacements) holds no KV blocks, and the
  service answers a normal request.

Each scenario prints one line (sent, completed, errored, hung, blocks leaked);
``pytest -s tests/chaos`` shows them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest
import ray

from kv_transfer.nixl import unavailable_reason
from tests.helpers import PATIENCE_S, async_wait_for, running_service

NEEDS_NIXL = pytest.mark.skipif(unavailable_reason() is not None, reason=f"nixl unavailable: {unavailable_reason()}")

N = 40  # requests per scenario (the first N_TRANSFER of them where every transfer is slowed or broken)
N_TRANSFER = 24
CONCURRENCY = 8
DEADLINE_S = 120.0  # per request: past this it counts as hung
CLIENT_RETRIES = 2
CHUNK_BUDGET = 64  # prefill tokens per step, so long prompts take several steps
# Every scenario's service: 2 + 2 workers, replaced when they die, with a small prefill
# budget, and short transfer deadlines, so that a survivor whose peer froze gives up
# within the test's patience (a dead peer fails its channel at once).
SETTINGS = dict(prefill_workers=2, decode_workers=2, restart_workers=True,
                engine={"num_kv_blocks": 512, "max_num_batched_tokens": CHUNK_BUDGET})
# Checksums on: a block that is not what was sent fails its transfer instead of being served.
DEADLINES = {"timeout_s": 5, "op_timeout_s": 10, "checksums": True}


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


@pytest.fixture(scope="module")
def workload(tiny_model):
    """N prompts (some long enough for several prefill chunks) and the reference texts."""
    from engine import LLM, SamplingParams

    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "kv", "block", "stream", "token", "prefill", "decode"]
    # About 2 tokens a word: the longest take 6 prefill chunks of CHUNK_BUDGET tokens.
    prompts = [" ".join(rng.choice(words) for _ in range(rng.choice([8, 30, 180]))) for _ in range(N)]
    lengths = [rng.randint(12, 40) for _ in range(N)]
    llm = LLM(model=tiny_model, num_kv_blocks=512)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    assert llm.stats().num_blocks_in_use == 0
    return prompts, lengths, [o.text for o in outs]


def _model_name(tiny_model: str) -> str:
    return tiny_model.rstrip("/").split("/")[-1]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, i: int, prompt: str, n: int, deadline_s: float = DEADLINE_S,
) -> Outcome:
    """One streaming greedy completion, retried like the openai client; hung past ``deadline_s``."""
    out = Outcome(i)
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


async def _load(url: str, model: str, workload, chaos, count: int = N) -> list[Outcome]:
    """Run the workload's first ``count`` requests CONCURRENCY at a time while
    ``chaos(progress)`` runs beside them."""
    prompts, lengths, _ = workload
    progress = {"finished": 0, "outcomes": []}
    queue = list(range(count))

    async def worker(client):
        while queue:
            i = queue.pop(0)
            o = await _one(client, url, model, i, prompts[i], lengths[i])
            progress["outcomes"].append(o)
            progress["finished"] += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(DEADLINE_S, connect=10)) as client:
        chaos_task = asyncio.create_task(chaos(progress))
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
        await chaos_task
    return sorted(progress["outcomes"], key=lambda o: o.index)


def _difference(o: Outcome, want: str) -> str:
    """Where a request's text left the reference, for the failure message."""
    at = next((i for i, (a, b) in enumerate(zip(o.text, want)) if a != b), min(len(o.text), len(want)))
    return (f"request {o.index} ({o.chunks} chunks, finish {o.finish_reason}, {o.retries} retries) differs at "
            f"char {at}: got {o.text[max(0, at - 20):at + 40]!r}, want {want[max(0, at - 20):at + 40]!r} "
            f"({len(o.text)} vs {len(want)} chars)")


def _judge(name: str, outcomes: list[Outcome], workload, svc, may_fail: bool, count: int = N) -> None:
    _, _, want = workload
    hung = [o.index for o in outcomes if o.hung]
    truncated = [o.index for o in outcomes if not o.hung and o.error is None and (o.text != want[o.index] or o.finish_reason != "length")]
    errored = [o for o in outcomes if o.error is not None]
    completed = len(outcomes) - len(errored) - len(hung)
    leaked = _blocks_after(svc)
    retried = sum(o.retries > 0 for o in outcomes)
    print(f"\nchaos[{name}]: sent {len(outcomes)}, completed {completed}, errored {len(errored)}, "
          f"hung {len(hung)}, blocks leaked {leaked}, retried by the client {retried}")
    assert len(outcomes) == count
    assert not hung, f"requests hung: {hung}"
    assert not truncated, "ended without error but not the reference text: " + "; ".join(
        _difference(o, want[o.index]) for o in outcomes if o.index in truncated
    )
    for o in errored:
        assert o.error.strip(), f"request {o.index}: an error without a message"
        assert may_fail, f"request {o.index} failed where it could have been re-run: {o.error}"
        assert o.chunks > 0, f"request {o.index} failed before any token reached it (re-runnable): {o.error}"
    assert leaked == 0, f"{leaked} KV blocks still in use"
    _assert_serves(svc)


def _blocks_after(svc, within_s: float = 60.0) -> int:
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


def _assert_serves(svc) -> None:
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(f"{svc.http_url}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def _workers(svc) -> tuple[list, list]:
    return ray.get(svc.controller.workers.remote())


async def _until(predicate, what: str) -> None:
    """Poll the async ``predicate`` (every 20 ms) until it holds."""
    await async_wait_for(predicate, PATIENCE_S, what, every_s=0.02)


async def _kill(handle) -> None:
    await asyncio.to_thread(ray.kill, handle, no_restart=True)


# ------------------------------------------------------------------ workers die


class Services:
    """One live service at a time (Serve holds one ``tandem`` app), one per transfer
    backend: asking for another backend shuts the current one down first. Each scenario
    sets the transfer faults it wants (none by default) on the running workers."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._backend: str | None = None
        self._ctx = None
        self._svc = None

    def get(self, backend: str = "object_store", **transfer):
        from kv_transfer.config import TransferConfig

        if backend != self._backend:
            self.close()
            self._ctx = running_service(self.model, **SETTINGS, transfer={"backend": backend, **DEADLINES})
            self._svc, self._backend = self._ctx.__enter__(), backend
        config = TransferConfig.from_dict({"backend": backend, **DEADLINES, **transfer})
        ray.get(self._svc.controller.set_transfer.remote(config))
        return self._svc

    def close(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx, self._backend = self._ctx, None, None
            ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def services(ray_cluster, tiny_model):
    s = Services(tiny_model)
    yield s
    s.close()


@pytest.fixture
def service(services):
    """The object store's service, no transfer faults."""
    return services.get()


def test_prefill_worker_killed_mid_chunked_prefill(service, tiny_model, workload):
    async def chaos(progress):
        prefill, _ = _workers(service)
        victims = []

        async def prefilling():
            # Either prefill worker will do: the one caught with chunks of a prompt still to run.
            if progress["finished"] < 5:
                return False
            loads = await asyncio.gather(*(w.handle.load.remote() for w in prefill))
            victims[:] = [w for w, load in zip(prefill, loads)
                          if load.running_chunks > 0 and load.queued_prefill_tokens > CHUNK_BUDGET]
            return victims

        await _until(prefilling, "a prefill worker mid chunked prefill, after 5 requests")
        await _kill(victims[0].handle)

    outcomes = asyncio.run(_load(service.http_url, _model_name(tiny_model), workload, chaos))
    _judge("prefill killed mid chunked prefill", outcomes, workload, service, may_fail=False)


def test_decode_worker_killed_mid_stream(service, tiny_model, workload, metrics_dir):
    from tests.helpers import metric_sum, scrape

    before = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total")

    async def chaos(progress):
        _, (victim, *_) = _workers(service)

        async def streaming():
            load = await victim.handle.load.remote()
            return progress["finished"] >= 5 and load.running >= 2

        await _until(streaming, "a decode worker streaming 2 requests, after 5 requests")
        await _kill(victim.handle)

    outcomes = asyncio.run(_load(service.http_url, _model_name(tiny_model), workload, chaos))
    # The streams it was serving move to the other decode worker: no client sees an error.
    _judge("decode killed mid stream", outcomes, workload, service, may_fail=False)
    moved = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total") - before
    assert moved > 0, "the kill should have caught streams mid-way and moved them"


def test_router_replica_restarted(service, tiny_model, workload):
    from ray import serve

    async def chaos(progress):
        async def under_way():
            return progress["finished"] >= 10

        await _until(under_way, "10 requests finished")
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "Router" in a["name"]]
        assert replicas, "no router replica found"
        for a in replicas:
            await _kill(ray.get_actor(a["name"], namespace=a["namespace"]))

    outcomes = asyncio.run(_load(service.http_url, _model_name(tiny_model), workload, chaos))
    assert serve.status().applications["tandem"].status == "RUNNING"
    _judge("router replica restarted", outcomes, workload, service, may_fail=True)


# ------------------------------------------------------------------ transfers


@pytest.mark.parametrize(
    "name,transfer",
    [
        ("transfers dropped", {"faults": {"drop_rate": 0.3, "seed": 2}}),
        ("transfers past deadline", {"timeout_s": 0.25, "faults": {"delay_s": 0.5}}),
    ],
)
def test_transfer_faults_fall_back_to_recompute(services, tiny_model, workload, name, transfer):
    svc = services.get(**transfer)
    before = _transfer_failures(svc)
    outcomes = asyncio.run(_load(svc.http_url, _model_name(tiny_model), workload, _no_chaos, N_TRANSFER))
    failures = _transfer_failures(svc) - before
    _judge(name, outcomes, workload, svc, may_fail=False, count=N_TRANSFER)
    assert failures > 0, "the fault setting should have made transfers fail"


async def _no_chaos(progress) -> None:
    return None


def _transfer_failures(svc) -> int:
    return sum(s.get("transfer_failures", 0) for s in svc.stats().values())


@pytest.fixture(params=["object_store", "collective", pytest.param("nixl", marks=NEEDS_NIXL)])
def slow_transfer_service(services, request):
    """Each KV receive waits 1 s first: there is always a transfer in flight to break, and
    it is still in flight when the kill lands (polling the loads, then killing, took over
    0.3 s on a loaded machine, and a transfer that had ended meanwhile broke nothing)."""
    return services.get(request.param, faults={"delay_s": 1.0})


async def _kill_mid_transfer(svc, progress, role: str) -> str:
    """Kill a worker while a transfer it takes part in is in flight; returns its id."""
    prefill, decode = _workers(svc)
    victim = None

    async def transferring():
        nonlocal victim
        if progress["finished"] < 5:
            return False
        if role == "sender":  # a prefill worker with a transfer going out
            loads = await asyncio.gather(*(w.handle.load.remote() for w in prefill))
            victim = next((w for w, load in zip(prefill, loads) if load.sending > 0), None)
        else:  # a decode worker with KV on its way in
            loads = await asyncio.gather(*(w.handle.load.remote() for w in decode))
            victim = next((w for w, load in zip(decode, loads) if load.waiting_for_kv > 0), None)
        return victim is not None

    await _until(transferring, f"a {role} with a transfer in flight, after 5 requests")
    await _kill(victim.handle)
    return victim.worker_id


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_worker_killed_mid_transfer(slow_transfer_service, tiny_model, workload, side):
    svc = slow_transfer_service
    before = {w.worker_id: w.key for w in _workers(svc)[side == "receiver"]}
    failures_before = _transfer_failures(svc)
    killed = []

    async def chaos(progress):
        killed.append(await _kill_mid_transfer(svc, progress, side))

    outcomes = asyncio.run(_load(svc.http_url, _model_name(tiny_model), workload, chaos, N_TRANSFER))

    async def replaced():
        after = {w.worker_id: w.key for w in _workers(svc)[side == "receiver"]}
        return after.get(killed[0], before[killed[0]]) != before[killed[0]]

    asyncio.run(_until(replaced, f"the killed {side} to be replaced"))
    if side == "sender":  # its cut transfer ended on the decode side: recomputed there
        assert _transfer_failures(svc) > failures_before, "the cut transfer should have been counted"
    # A dead sender loses nothing; a dead receiver's streams move to the other decode worker.
    _judge(f"{side} killed mid transfer", outcomes, workload, svc, may_fail=False, count=N_TRANSFER)
