"""Disaggregated services whose prefill and decode workers run at different tensor-parallel
sizes (``kv_transfer.sharded``): prefill TP 2 -> decode TP 1, TP 1 -> TP 2 and TP 2 -> TP 2,
over nixl (each decode rank reads its KV heads from the prefill ranks holding them).

Each pairing streams the greedy text of one offline engine at TP 1 (itself equal to
transformers', ``tests/unit/test_hf_parity.py``) with every block's checksum checked, frees
every block on every worker, and its decode ranks' transfer stats show each rank received
exactly its share of the heads (2 -> 1 and 1 -> 2 the same bytes in all). The
transfer between TP 4 and TP 2 ranks is in ``tests/unit/test_sharded_transfer.py``.

Chaos at TP 2 -> TP 2: a prefill worker's rank killed while its KV is being read (each read
delayed by injected faults, so reads are always under way), then a decode worker's rank
killed mid-stream. Each takes its worker down whole, the pool replaces it with a rank group
of its own, and every request ends with the reference text (re-run, or its KV recomputed by
the failure policy) or a clear error; none hangs and no block is left held on any worker.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from kv_transfer.config import TransferConfig
from kv_transfer.nixl import unavailable_reason
from tests.chaos.streams import judge, kill, model_name, reference, run_load, until, workers
from tests.helpers import PATIENCE_S, running_service, wait_for

NIXL_MISSING = unavailable_reason()
pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl unavailable: {NIXL_MISSING}")

@pytest.fixture(scope="module")
def workload(tiny_model):
    # Prompts unlike from their first token on: no decode worker finds a prefix of one cached,
    # so every pairing moves every prompt's blocks (long ones in pipelined parts).
    words = ["alpha", "beta", "gamma", "delta", "kv", "block", "stream", "token", "rank", "shard"]
    prompts = [f"{i} " + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(n))
               for i, n in enumerate([40, 6, 25, 60, 12, 33])]
    return reference(tiny_model, prompts, [12] * len(prompts))


async def _no_chaos(progress):
    pass


def _settings(prefill_tp: int, decode_tp: int, **more) -> dict:
    return dict(prefill_engine={"tensor_parallel_size": prefill_tp}, decode_engine={"tensor_parallel_size": decode_tp},
                transfer={"backend": "nixl", "checksums": True}, **more)


def _served(service, model: str, workload, name: str, decode_tp: int) -> list[int]:
    """Run the workload undisturbed: every request the reference text, every block back; the
    bytes each decode rank received (its own transfer stats)."""
    outcomes = asyncio.run(run_load(service.http_url, model_name(model), workload, _no_chaos, len(workload[0]), 3))
    judge(name, outcomes, workload, service, may_fail=False, count=len(workload[0]))
    (decode,) = workers(service)[1]
    transfer = ray.get(decode.handle.stats.remote())["transfer"]
    assert not transfer["failures"], transfer["failures"]
    ranks = transfer.get("ranks", [transfer])
    assert len(ranks) == decode_tp
    received = [r["bytes_received"] for r in ranks]
    assert min(received) > 0 and len(set(received)) == 1, f"{name}: each decode rank reads its half: {received}"
    return received


def test_prefill_wider_or_narrower_than_decode_serves_one_ranks_text_moving_the_same_bytes(
        ray_cluster, tiny_model, workload):
    received = {}
    for a, b in ((2, 1), (1, 2)):
        with running_service(tiny_model, **_settings(a, b)) as service:
            received[(a, b)] = _served(service, tiny_model, workload, f"prefill tp{a} -> decode tp{b}", b)
    print(f"\nKV bytes each decode rank received, by (prefill, decode) tensor_parallel_size: {received}")
    assert sum(received[(2, 1)]) == sum(received[(1, 2)]), f"either way, the same bytes: {received}"


def _rank_1(worker) -> object:
    return ray.get_actor(f"{worker.incarnation}-rank-1")


async def _replaced(service, victim, pool: int) -> bool:
    listed = (await asyncio.to_thread(workers, service))[pool]
    return bool(listed) and all(w.incarnation != victim.incarnation for w in listed)


def test_at_tp2_both_sides_a_rank_killed_mid_transfer_or_mid_stream_takes_its_worker_down_whole(
        ray_cluster, tiny_model, workload):
    with running_service(tiny_model, **_settings(2, 2, restart_workers=True, health_check_s=0.5)) as service:
        half = _served(service, tiny_model, workload, "prefill tp2 -> decode tp2", 2)
        print(f"\nKV bytes each decode rank received at TP 2 -> TP 2: {half}")
        # Every read takes 0.2 s more: reads are under way whenever a request waits for its first token.
        config = TransferConfig.from_dict({"backend": "nixl", "checksums": True, "faults": {"delay_s": 0.2}})
        ray.get(service.controller.set_transfer.remote(config))
        for pool, what in ((0, "prefill rank killed mid-transfer"), (1, "decode rank killed mid-stream")):
            (victim,) = workers(service)[pool]
            rank = _rank_1(victim)

            async def chaos(progress, pool=pool, rank=rank, what=what):
                # Mid-transfer: a request not streaming yet while others finished; mid-stream: one
                # with tokens delivered. The load stops once the rank is killed; its requests end.
                async def now() -> bool:
                    live = progress["live"].values()
                    return progress["finished"] > 0 and any((o.chunks == 0) if pool == 0 else (o.chunks > 0)
                                                            for o in live)

                await until(now, what)
                await kill(rank)

            outcomes = asyncio.run(run_load(service.http_url, model_name(tiny_model), workload, chaos, None, 3))
            judge(f"tp2 -> tp2, {what}", outcomes, workload, service, may_fail=True, count=len(outcomes))
            wait_for(lambda: asyncio.run(_replaced(service, victim, pool)), PATIENCE_S, f"the {what} worker replaced")
            (replacement,) = workers(service)[pool]
            assert _rank_1(replacement) is not None, "the replacement has a rank group of its own"
