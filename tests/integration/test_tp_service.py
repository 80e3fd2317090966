"""A colocated service whose one worker runs at tensor_parallel_size 2: the worker's actor is
rank 0 and a rank actor in the second bundle of its placement group is rank 1
(``cluster.rank_actors``).

Greedy streams equal one rank's text (the offline engine at TP 1, which equals transformers'
in ``tests/unit/test_hf_parity.py``), and every KV block is back at the end. A rank actor
killed while streams run takes its worker down whole: every stream ends with the reference
text (moved to the replacement, which recomputes what was sent) or with a clear error, none
hangs, no block leaks, and the pool's replacement has a rank group of its own. A rank that
dies while its worker idles takes the worker down as soon (no step has to find it out).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import ray

from tests.chaos.streams import judge, model_name, reference, run_load, until, workers

TP = 2


@pytest.fixture(scope="module")
def service_settings() -> dict:
    return dict(prefill_workers=0, decode_workers=1, decode_engine={"tensor_parallel_size": TP},
                restart_workers=True, health_check_s=0.5)


@pytest.fixture(scope="module")
def workload(tiny_model):
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "kv", "block", "stream", "token", "rank", "shard"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.choice([6, 25, 60]))) for _ in range(8)]
    lengths = [rng.randint(16, 40) for _ in prompts]
    return reference(tiny_model, prompts, lengths)


def _rank_actor(worker) -> str:
    """The name of the rank actor of ``worker`` (its actor's name, then the rank)."""
    return f"{worker.incarnation}-rank-1"


def _alive(name: str) -> bool:
    from ray._private.state import actors

    return any(a["Name"] == name and a["State"] == "ALIVE" for a in actors().values())


def test_a_worker_at_tp2_streams_one_ranks_greedy_text_and_frees_every_block(service, tiny_model, workload):
    (decode,) = workers(service)[1]
    assert _alive(_rank_actor(decode)), "the worker's rank 1 runs as an actor of its own"

    async def no_chaos(progress):
        pass

    outcomes = asyncio.run(run_load(service.http_url, model_name(tiny_model), workload, no_chaos, 8, 4))
    judge("tp2 serves", outcomes, workload, service, may_fail=False, count=8)


def test_a_killed_rank_takes_its_worker_down_whole_and_the_pool_replaces_it(service, tiny_model, workload):
    (victim,) = workers(service)[1]
    rank = ray.get_actor(_rank_actor(victim))

    async def chaos(progress):
        await until(lambda: _streaming(progress), "a stream with tokens delivered")
        await asyncio.to_thread(ray.kill, rank, no_restart=True)
        await until(lambda: _replaced(service, victim), "the pool's replacement worker listed")

    outcomes = asyncio.run(run_load(service.http_url, model_name(tiny_model), workload, chaos, None, 4))
    judge("tp2 rank killed", outcomes, workload, service, may_fail=True, count=len(outcomes))
    (replacement,) = workers(service)[1]
    assert replacement.incarnation != victim.incarnation
    assert _alive(_rank_actor(replacement)), "the replacement has a rank group of its own"
    assert not _alive(_rank_actor(victim)) and not _alive(victim.incarnation), "the old worker is gone whole"


def test_a_rank_that_dies_while_its_worker_idles_takes_the_worker_down_at_once(service, tiny_model, workload):
    """No step finds it out: the worker waits on its ranks, and ends when one does."""
    from tests.helpers import PATIENCE_S, wait_for

    (victim,) = workers(service)[1]
    ray.kill(ray.get_actor(_rank_actor(victim)), no_restart=True)
    wait_for(lambda: asyncio.run(_replaced(service, victim)), PATIENCE_S, "the idle worker replaced")
    assert not _alive(victim.incarnation)

    async def no_chaos(progress):
        pass

    outcomes = asyncio.run(run_load(service.http_url, model_name(tiny_model), workload, no_chaos, 4, 4))
    judge("tp2 after an idle rank died", outcomes, workload, service, may_fail=False, count=4)


async def _streaming(progress) -> bool:
    return any(o.chunks > 0 for o in progress["live"].values())


async def _replaced(service, victim) -> bool:
    decode = (await asyncio.to_thread(workers, service))[1]
    return bool(decode) and all(w.incarnation != victim.incarnation for w in decode)
