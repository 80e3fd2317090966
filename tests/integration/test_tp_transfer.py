"""Disaggregated services whose prefill and decode workers run at different tensor-parallel
sizes (``kv_transfer.sharded``): prefill TP 2 -> decode TP 1, TP 1 -> TP 2 and TP 2 -> TP 2,
over nixl (each decode rank reads its KV heads from the prefill ranks holding them).

Each pairing streams the greedy text of one offline engine at TP 1 (itself equal to
transformers', ``tests/unit/test_hf_parity.py``) with every block's checksum checked, frees
every block on every worker, and its decode ranks' transfer stats show each rank received
exactly its share of the heads: the same bytes in all as a pairing of equal sizes. The
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

from kv_transfer.nixl import unavailable_reason
from tests.chaos.streams import judge, kill, model_name, reference, run_load, until, workers
from tests.helpers import running_service

NIXL_MISSING = unavailable_reason()
pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl unavailable: {NIXL_MISSING}")

PAIRINGS = [(2, 1), (1, 2), (2, 2)]  # (prefill, decode) tensor_parallel_size


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


def _serve(ray_cluster, model: str, workload, prefill_tp: int, decode_tp: int) -> list[int]:
    """Run the workload on a service of that pairing; the decode ranks' bytes received."""
    settings = dict(prefill_engine={"tensor_parallel_size": prefill_tp},
                    decode_engine={"tensor_parallel_size": decode_tp},
                    transfer={"backend": "nixl", "checksums": True})
    with running_service(model, **settings) as service:
        outcomes = asyncio.run(run_load(service.http_url, model_name(model), workload, _no_chaos,
                                        len(workload[0]), 3))
        judge(f"prefill tp{prefill_tp} -> decode tp{decode_tp}", outcomes, workload, service, may_fail=False,
              count=len(workload[0]))
        (decode,) = workers(service)[1]
        transfer = ray.get(decode.handle.stats.remote())["transfer"]
        assert not transfer["failures"], transfer["failures"]
        ranks = transfer.get("ranks", [transfer])
        assert len(ranks) == decode_tp
        return [r["bytes_received"] for r in ranks]


def test_every_tp_pairing_serves_one_ranks_greedy_text_each_decode_rank_reading_its_share(
        ray_cluster, tiny_model, workload):
    received = {pairing: _serve(ray_cluster, tiny_model, workload, *pairing) for pairing in PAIRINGS}
    print(f"\nKV bytes each decode rank received, by (prefill, decode) tensor_parallel_size: {received}")
    totals = {pairing: sum(b) for pairing, b in received.items()}
    assert all(b > 0 for per_rank in received.values() for b in per_rank), received
    for pairing, per_rank in received.items():
        assert len(set(per_rank)) == 1, f"{pairing}: each decode rank reads its half of the heads: {per_rank}"
    assert totals[(2, 1)] == totals[(1, 2)] == totals[(2, 2)], f"hetero pairings move no more bytes: {totals}"


def _rank_1(worker) -> object:
    return ray.get_actor(f"{worker.incarnation}-rank-1")


async def _replaced(service, victim, pool: int) -> bool:
    listed = (await asyncio.to_thread(workers, service))[pool]
    return bool(listed) and all(w.incarnation != victim.incarnation for w in listed)


def test_a_rank_killed_mid_transfer_or_mid_stream_takes_its_worker_down_whole_and_loses_nothing(
        ray_cluster, tiny_model, workload):
    settings = dict(engine={"tensor_parallel_size": 2}, restart_workers=True, health_check_s=0.5,
                    transfer={"backend": "nixl", "checksums": True, "faults": {"delay_s": 0.2}})
    with running_service(tiny_model, **settings) as service:
        for pool, what in ((0, "prefill rank killed mid-transfer"), (1, "decode rank killed mid-stream")):
            (victim,) = workers(service)[pool]
            rank = _rank_1(victim)

            async def chaos(progress, pool=pool, victim=victim, rank=rank):
                # Mid-transfer: a request not streaming yet while others finished (reads take 0.2 s
                # at least); mid-stream: a request with tokens delivered.
                def moment() -> bool:
                    live = progress["live"].values()
                    return progress["finished"] > 0 and any((o.chunks == 0) if pool == 0 else (o.chunks > 0)
                                                            for o in live)

                async def now() -> bool:
                    return moment()

                await until(now, what)
                await kill(rank)
                await until(lambda: _replaced(service, victim, pool), f"the {what} worker replaced")

            outcomes = asyncio.run(run_load(service.http_url, model_name(tiny_model), workload, chaos, None, 3))
            judge(f"tp2 -> tp2, {what}", outcomes, workload, service, may_fail=True, count=len(outcomes))
            (replacement,) = workers(service)[pool]
            assert _rank_1(replacement) is not None, "the replacement has a rank group of its own"
