"""``LLMEngine.reset``: a worker switching roles keeps its model and KV cache and starts
over under the new role's scheduler settings."""

from __future__ import annotations

import dataclasses

import pytest

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[r] for r in rids]


@pytest.fixture(scope="module")
def config(tiny_model) -> EngineConfig:
    return EngineConfig(model=tiny_model, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)


def test_a_reset_engine_frees_every_block_empties_its_prefix_cache_and_takes_the_new_scheduler_settings(config):
    engine = LLMEngine(config)
    prompts = [list(range(5, 5 + 40)), list(range(9, 9 + 33))]
    before = _run(engine, prompts)
    assert engine.kv_manager.pool.num_cached_blocks > 0, "the run should have left cached prefixes"
    model, k = engine.model, engine.kv_cache.k

    decode = dataclasses.replace(config, max_num_batched_tokens=512, max_num_seqs=3, enable_chunked_prefill=False)
    engine.reset(decode)

    assert engine.model is model and engine.kv_cache.k is k, "the model and the KV cache must stay"
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and pool.num_cached_blocks == 0
    assert engine.scheduler.config.max_num_seqs == 3
    assert engine.scheduler.config.max_num_batched_tokens >= 512
    assert engine.stats().num_steps == 0 and engine.stats().prefix_cache_queries == 0
    assert _run(engine, prompts) == before, "the same greedy tokens under the new settings"
    assert engine.stats().prefix_cache_hits == 0, "nothing may be served from the old prefix cache"


def test_a_reset_is_refused_while_the_engine_holds_a_request_or_for_a_setting_it_cannot_change(config):
    engine = LLMEngine(config)
    engine.add_request(list(range(3, 30)), GREEDY, request_id="busy")
    engine.step()
    with pytest.raises(RuntimeError, match="busy"):
        engine.reset(config)
    engine.abort("busy")
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.reset(dataclasses.replace(config, num_kv_blocks=32))
    engine.reset(config)  # idle now: allowed
    assert engine.kv_manager.pool.num_used_blocks == 0
