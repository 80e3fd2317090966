"""A pool worker at tensor_parallel_size 2 switching roles in this process (no Ray): its
ranks are started once, by what its actor is given (``ranks``: here local processes in
place of the service's rank actors), and a switch keeps them (an engine reset renews only
rank 0's scheduler and blocks): the greedy tokens before and after equal one rank's."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.pool_worker import PoolWorker
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.ranks import RankState, TensorParallel, start_ranks
from kv_transfer.config import TransferConfig
from tests.unit.test_pool_worker import PROMPT, SHORT, _run


class _CountedRanks:
    """A ``RankStarter`` that starts the ranks as local processes and counts its starts."""

    def __init__(self) -> None:
        self.starts = 0

    def start(self, config: EngineConfig) -> TensorParallel:
        self.starts += 1
        return start_ranks(config)


@pytest.fixture(scope="module")
def configs(tiny_model) -> dict[str, EngineConfig]:
    decode = EngineConfig(model=tiny_model, num_kv_blocks=64, max_num_seqs=4)
    return {"prefill": dataclasses.replace(decode, max_num_batched_tokens=256, max_num_seqs=2), "decode": decode}


def test_a_tp2_pool_worker_keeps_its_ranks_across_role_switches(configs):
    one_rank = LLMEngine(configs["decode"])
    one_rank.add_request(PROMPT, SHORT, request_id="ref")
    while one_rank.has_unfinished_requests():
        for out in one_rank.step():
            reference = out.token_ids
    tp2 = {role: dataclasses.replace(c, tensor_parallel_size=2) for role, c in configs.items()}
    ranks = _CountedRanks()

    async def scenario():
        worker = PoolWorker("decode", "decode-0", tp2, TransferConfig(backend="inprocess"), ranks=ranks)
        await worker.ready()
        engine = worker.worker.engine
        try:
            assert (await _run(worker, "a", SHORT, epoch=0))[0] == reference
            await worker.switch_role("prefill", "prefill-1")
            await worker.switch_role("decode", "decode-2")
            assert worker.worker.engine is engine and engine.tensor_parallel.state == RankState.RUNNING
            assert (await _run(worker, "b", SHORT, epoch=2))[0] == reference
            assert (await worker.stats())["num_blocks_in_use"] == 0
        finally:
            await worker.worker.async_engine.stop()
            engine.close()

    asyncio.run(scenario())
    assert ranks.starts == 1, "the ranks start with the worker's first role only"
