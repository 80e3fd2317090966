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
``pytest -s tests/chaos`` shows them. The load and the verdict are ``tests/chaos/streams.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
import ray

from tests.chaos.streams import (
    ALL_BACKENDS,
    Outcome,
    backends,
    judge,
    kill,
    model_name,
    reference,
    run_load,
    services_fixture,
    until,
    workers,
)

N = 40  # requests per scenario (the first N_TRANSFER of them where every transfer is slowed or broken)
N_TRANSFER = 24
CONCURRENCY = 8
CHUNK_BUDGET = 64  # prefill tokens per step, so long prompts take several steps
# Every scenario's service: 2 + 2 workers, replaced when they die, with a small prefill
# budget, and short transfer deadlines, so that a survivor whose peer froze gives up
# within the test's patience (a dead peer fails its channel at once).
SETTINGS = dict(prefill_workers=2, decode_workers=2, restart_workers=True,
                engine={"num_kv_blocks": 512, "max_num_batched_tokens": CHUNK_BUDGET})
# Checksums on: a block that is not what was sent fails its transfer instead of being served.
DEADLINES = {"timeout_s": 5, "op_timeout_s": 10, "checksums": True}


@pytest.fixture(scope="module")
def workload(tiny_model):
    """N prompts (some long enough for several prefill chunks) and the reference texts."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "kv", "block", "stream", "token", "prefill", "decode"]
    # About 2 tokens a word: the longest take 6 prefill chunks of CHUNK_BUDGET tokens.
    prompts = [" ".join(rng.choice(words) for _ in range(rng.choice([8, 30, 180]))) for _ in range(N)]
    lengths = [rng.randint(12, 40) for _ in range(N)]
    return reference(tiny_model, prompts, lengths)


async def _load(url: str, model: str, workload, chaos, count: int | None = N) -> list[Outcome]:
    """Run the workload's first ``count`` requests (None: round and round until the
    chaos is done) CONCURRENCY at a time while ``chaos(progress)`` runs beside them."""
    return await run_load(url, model, workload, chaos, count, CONCURRENCY)


def _judge(name: str, outcomes: list[Outcome], workload, svc, may_fail: bool, count: int = N) -> None:
    judge(name, outcomes, workload, svc, may_fail, count)


# ------------------------------------------------------------------ workers die


services = services_fixture(SETTINGS, DEADLINES)


@pytest.fixture
def service(services):
    """The object store's service, no transfer faults."""
    return services.get()


def test_prefill_worker_killed_mid_chunked_prefill(service, tiny_model, workload):
    async def chaos(progress):
        prefill, _ = workers(service)
        victims = []

        async def prefilling():
            # Either prefill worker will do: the one caught with chunks of a prompt still to run.
            if progress["finished"] < 5:
                return False
            loads = await asyncio.gather(*(w.handle.load.remote() for w in prefill))
            victims[:] = [w for w, load in zip(prefill, loads)
                          if load.running_chunks > 0 and load.queued_prefill_tokens > CHUNK_BUDGET]
            return victims

        await until(prefilling, "a prefill worker mid chunked prefill, after 5 requests")
        await kill(victims[0].handle)

    outcomes = asyncio.run(_load(service.http_url, model_name(tiny_model), workload, chaos))
    _judge("prefill killed mid chunked prefill", outcomes, workload, service, may_fail=False)


def test_decode_worker_killed_mid_stream(service, tiny_model, workload, metrics_dir):
    from tests.helpers import metric_sum, scrape

    before = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total")

    async def chaos(progress):
        _, (victim, *_) = workers(service)

        async def streaming():
            load = await victim.handle.load.remote()
            return progress["finished"] >= 5 and load.running >= 2

        await until(streaming, "a decode worker streaming 2 requests, after 5 requests")
        await kill(victim.handle)

    outcomes = asyncio.run(_load(service.http_url, model_name(tiny_model), workload, chaos))
    # The streams it was serving move to the other decode worker: no client sees an error.
    _judge("decode killed mid stream", outcomes, workload, service, may_fail=False)
    moved = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total") - before
    assert moved > 0, "the kill should have caught streams mid-way and moved them"


def test_router_replica_restarted(service, tiny_model, workload):
    from ray import serve

    async def chaos(progress):
        async def under_way():
            return progress["finished"] >= 10

        await until(under_way, "10 requests finished")
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "Router" in a["name"]]
        assert replicas, "no router replica found"
        for a in replicas:
            await kill(ray.get_actor(a["name"], namespace=a["namespace"]))

    outcomes = asyncio.run(_load(service.http_url, model_name(tiny_model), workload, chaos))
    assert serve.status().applications["tandem"].status == "RUNNING"
    _judge("router replica restarted", outcomes, workload, service, may_fail=True)


# ------------------------------------------------------------------ transfers


@pytest.mark.parametrize("backend", backends("object_store"))
@pytest.mark.parametrize(
    "name,transfer",
    [
        ("transfers dropped", {"faults": {"drop_rate": 0.3, "seed": 2}}),
        ("transfers past deadline", {"timeout_s": 0.25, "faults": {"delay_s": 0.5}}),
    ],
)
def test_transfer_faults_fall_back_to_recompute(services, tiny_model, workload, name, transfer, backend):
    svc = services.get(backend, **transfer)
    before = _transfer_failures(svc)
    outcomes = asyncio.run(_load(svc.http_url, model_name(tiny_model), workload, _no_chaos, N_TRANSFER))
    failures = _transfer_failures(svc) - before
    _judge(name, outcomes, workload, svc, may_fail=False, count=N_TRANSFER)
    assert failures > 0, "the fault setting should have made transfers fail"


async def _no_chaos(progress) -> None:
    return None


def _transfer_failures(svc) -> int:
    return sum(s.get("transfer_failures", 0) for s in svc.stats().values())


# Each KV receive waits this long first, so there is always a transfer in flight to
# break, and it is still in flight when the kill lands: polling the loads, then killing,
# took over 0.3 s on a loaded machine, and over 1 s with other jobs on its two cores (a
# transfer that had ended meanwhile broke nothing, and the sender's check below failed).
SLOW_RECEIVE_S = {"receiver": 1.0, "sender": 2.5}


async def _kill_mid_transfer(svc, progress, role: str) -> str:
    """Kill a worker while a transfer it takes part in is in flight; returns its id."""
    prefill, decode = workers(svc)
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

    await until(transferring, f"a {role} with a transfer in flight, after 5 requests")
    await kill(victim.handle)
    return victim.worker_id


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_worker_killed_mid_transfer(services, tiny_model, workload, side, backend):
    svc = services.get(backend, faults={"delay_s": SLOW_RECEIVE_S[side]})
    before = {w.worker_id: w.key for w in workers(svc)[side == "receiver"]}
    failures_before = _transfer_failures(svc)
    killed = []

    async def chaos(progress):
        killed.append(await _kill_mid_transfer(svc, progress, side))

    outcomes = asyncio.run(_load(svc.http_url, model_name(tiny_model), workload, chaos, N_TRANSFER))

    async def replaced():
        after = {w.worker_id: w.key for w in workers(svc)[side == "receiver"]}
        return after.get(killed[0], before[killed[0]]) != before[killed[0]]

    asyncio.run(until(replaced, f"the killed {side} to be replaced"))
    if side == "sender":  # its cut transfer ended on the decode side: recomputed there
        assert _transfer_failures(svc) > failures_before, "the cut transfer should have been counted"
    # A dead sender loses nothing; a dead receiver's streams move to the other decode worker.
    _judge(f"{side} killed mid transfer", outcomes, workload, svc, may_fail=False, count=N_TRANSFER)


FREEZE_S = 8.0  # past the transfer deadline (DEADLINES), short of the health check's ping timeout


@pytest.fixture(params=backends("collective"))
def paced_service(services, request):
    """Each KV receive waits 0.5 s first, so work piles up on the prefill workers to freeze."""
    return services.get(request.param, faults={"delay_s": 0.5})


def test_prefill_worker_frozen_mid_prefill(paced_service, tiny_model, workload):
    """A prefill worker stopped with SIGSTOP while it has work (alive to Ray, silent) for
    longer than the transfer deadline: the decode workers waiting on its KV give up at the
    deadline and compute those prompts themselves, and thawed, it finds its hand-offs
    expired and drops them. No client sees an error (no token had reached one), every
    text is the undisturbed one, and no worker keeps a block."""
    svc = paced_service
    prefill, _ = workers(svc)
    frozen: dict = {}

    async def chaos(progress):
        async def busy():
            loads = await asyncio.gather(*(w.handle.load.remote() for w in prefill))
            frozen["victim"] = next(
                (w for w, load in zip(prefill, loads) if load.running_chunks or load.waiting), None
            )
            return progress["finished"] >= 3 and frozen["victim"] is not None

        await until(busy, "a prefill worker with work, after 3 requests")
        pid = (await frozen["victim"].handle.ready.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            frozen["at"] = progress["finished"]
            await asyncio.sleep(FREEZE_S)
        finally:
            os.kill(pid, signal.SIGCONT)

    failures_before = _transfer_failures(svc)
    # The load goes on until the freeze is over: a slow machine does not run out of it first.
    outcomes = asyncio.run(_load(svc.http_url, model_name(tiny_model), workload, chaos, None))
    _judge("prefill worker frozen", outcomes, workload, svc, may_fail=False, count=len(outcomes))
    assert "at" in frozen, "the victim was never frozen"
    assert _transfer_failures(svc) > failures_before, "transfers from the frozen worker should have timed out"
    assert {w.worker_id for w in workers(svc)[0]} == {w.worker_id for w in prefill}, "no worker was replaced"
