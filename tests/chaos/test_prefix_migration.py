"""Chaos: decode workers die again and again under streams whose prompts share a long prefix.

A live service with 2 prefill and 3 decode workers (replaced when they die) serves N
streaming greedy completions, CONCURRENCY at a time, whose prompts all begin with the
same PREFIX_WORDS words (several KV blocks). The router's prefix affinity sends them to
the prefill worker whose prefix cache holds that start, so every re-run and every moved
stream is prefilled on the worker that also ran (and may still hold) the attempt the
dead decode worker was reading: the old attempt's abort and the new attempt's prefill
meet there. Each KV receive is delayed RECEIVE_DELAY_S (``transfer.faults.delay_s``), so
that transfers are in flight often. While the load runs, KILLS decode workers are killed
one after another, each while it streams 2 or more requests and has KV on its way in:
its streams move, and its requests still waiting for their KV are re-run.

The verdict (``tests/chaos/streams.py``): every stream ends with the undisturbed greedy
text, or with an error that names the bound it ran past (``max_retries`` or
``max_migrations``); none hangs; afterwards every worker, survivors and replacements,
holds no KV blocks, and the service answers. Beside it: the kills moved streams, and the
prefill workers' prefix caches were hit. A test run uses the collective backend;
``scripts/chaos`` runs it on every backend.

    .venv/bin/python -m pytest -q -s tests/chaos/test_prefix_migration.py
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray

from tests.chaos.streams import backends, judge, kill, model_name, reference, run_load, services_fixture, until, workers

N = 32
CONCURRENCY = 8
PREFIX_WORDS = 60  # about 2 tokens a word: 7 or more full blocks of 16 tokens shared by every prompt
KILLS = 3
KILL_AFTER = (3, 9, 15)  # requests finished before each kill, so that each lands on streams in flight
# How long a kill waits for a victim with KV on its way in before taking one that only streams.
RECEIVING_WAIT_S = 5.0
CHUNK_BUDGET = 64  # the shared prefix takes a few prefill chunks
RECEIVE_DELAY_S = 0.3
SETTINGS = dict(prefill_workers=2, decode_workers=3, restart_workers=True,
                engine={"num_kv_blocks": 512, "max_num_batched_tokens": CHUNK_BUDGET})
DEADLINES = {"timeout_s": 5, "op_timeout_s": 10, "checksums": True}


@pytest.fixture(scope="module")
def workload(tiny_model):
    """N prompts sharing a PREFIX_WORDS-word start, each with its own few words after it,
    and the reference texts."""
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "kv", "block", "stream", "token", "prefill", "decode"]
    prefix = " ".join(rng.choice(words) for _ in range(PREFIX_WORDS))
    prompts = [prefix + " " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(N)]
    lengths = [rng.randint(24, 56) for _ in range(N)]
    return reference(tiny_model, prompts, lengths)


services = services_fixture(SETTINGS, DEADLINES)


@pytest.fixture(params=backends("collective"))
def paged_service(services, request):
    return services.get(request.param, faults={"delay_s": RECEIVE_DELAY_S})


async def _streaming_decode_worker(svc, receiving: bool):
    """A live decode worker running 2 or more requests (and, if ``receiving``, with KV on
    its way in), or None."""
    _, decode = workers(svc)
    loads = await asyncio.gather(*(w.handle.load.remote() for w in decode), return_exceptions=True)
    for w, load in zip(decode, loads):  # one being replaced does not answer
        if not isinstance(load, BaseException) and load.running >= 2 and (load.waiting_for_kv >= 1 or not receiving):
            return w
    return None


def _prefix_cache_hits(svc) -> int:
    prefill, _ = workers(svc)
    return sum(load.prefix_cache_hits for load in ray.get([w.handle.load.remote() for w in prefill]))


def _past_a_bound(o) -> bool:
    return "max_retries" in o.error or "max_migrations" in o.error


def test_repeated_decode_kills_under_a_shared_prefix(paged_service, tiny_model, workload, metrics_dir):
    """KILLS decode workers die, each mid-stream (and mid-transfer when one is caught within
    RECEIVING_WAIT_S); every stream still ends with the undisturbed greedy text (or an error naming max_retries / max_migrations), streams
    moved, the prefill prefix cache was used, and no worker keeps a KV block."""
    from tests.helpers import metric_sum, scrape

    svc = paged_service
    moved_before = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total")
    hits_before = _prefix_cache_hits(svc)
    killed = []

    async def chaos(progress):
        for after in KILL_AFTER:
            victim, since = [], []

            async def streaming():
                if progress["finished"] < after:
                    return False
                since[:] = since or [time.monotonic()]
                receiving = time.monotonic() - since[0] < RECEIVING_WAIT_S
                victim[:] = [w for w in [await _streaming_decode_worker(svc, receiving)] if w is not None]
                return victim

            await until(streaming, f"a decode worker streaming 2 requests, after {after} requests")
            await kill(victim[0].handle)
            killed.append(victim[0].worker_id)

    outcomes = asyncio.run(run_load(svc.http_url, model_name(tiny_model), workload, chaos, None, CONCURRENCY))
    judge(f"{KILLS} decode kills, shared prefix", outcomes, workload, svc, may_fail=False, count=len(outcomes),
          excused=_past_a_bound)
    moved = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total") - moved_before
    print(f"killed {killed}; streams moved {moved:.0f}")
    assert len(killed) == KILLS
    assert moved >= KILLS, f"each kill should have caught streams mid-way and moved them; {moved:.0f} moved"
    assert _prefix_cache_hits(svc) > hits_before, "the shared prefix should have come from a prefill prefix cache"
