"""The simulator runs the engine's own scheduler and block pool, never a copy: a change to a
scheduling decision in ``engine/`` changes what the simulator reports on a fixed trace."""

from __future__ import annotations

import engine.core.scheduler
from engine.core.block_pool import KVCacheManager
from router.worker_loads import WorkerLoads
from sim.cost import DEVICES, CostModel, model_spec
from sim.report import summary
from sim.simulator import Simulator, run
from sim.topology import SimTopology
from sim.workload import SimRequest

COST = CostModel(DEVICES["H100"], model_spec("llama-3.1-8b"))


def _trace() -> list[SimRequest]:
    # Long prompts arriving together: chunking and admission decide who waits.
    return [SimRequest(0.001 * i, 1500 + 37 * i, 20 + i) for i in range(12)]


def _colocated(**engine) -> SimTopology:
    return SimTopology(prefill_workers=0, decode_workers=1, engine={"max_num_batched_tokens": 2048, **engine})


def test_each_simulated_worker_holds_the_engines_scheduler_and_block_manager():
    sim = Simulator(SimTopology(prefill_workers=1, decode_workers=2), COST, _trace())
    workers = sim.pools["prefill"] + sim.pools["decode"]
    assert len(workers) == 3
    for w in workers:
        assert type(w.scheduler) is engine.core.scheduler.Scheduler, f"{w.worker_id} runs {type(w.scheduler)}"
        assert type(w.kv) is KVCacheManager and w.scheduler.kv_manager is w.kv


def test_the_simulated_router_places_with_the_dispatchers_own_worker_loads(monkeypatch):
    sim = Simulator(SimTopology(prefill_workers=1, decode_workers=2), COST, _trace())
    assert type(sim.router.loads) is WorkerLoads
    chosen = []
    real = WorkerLoads.choose_decode

    def spy(self, workers, blocks, *args, **kwargs):
        chosen.append(blocks)
        return real(self, workers, blocks, *args, **kwargs)

    monkeypatch.setattr(WorkerLoads, "choose_decode", spy)
    summary(sim.run())
    assert len(chosen) >= len(_trace()), "every request is placed through WorkerLoads.choose_decode"


def test_a_scheduling_change_in_the_engine_changes_the_simulated_run(monkeypatch):
    before = summary(run(_colocated(), COST, _trace()))

    # The engine's admission policy now lets waiting requests join only when nothing runs.
    monkeypatch.setattr(engine.core.scheduler.ContinuousBatching, "admits",
                        lambda self, num_running, num_swapped: num_running == 0)
    after = summary(run(_colocated(), COST, _trace()))

    assert after["completed"] == before["completed"] == 12
    assert after["ttft_ms"]["mean"] > 1.5 * before["ttft_ms"]["mean"], (
        f"one batch at a time should delay first tokens: TTFT mean {before['ttft_ms']['mean']:.1f} ms "
        f"before, {after['ttft_ms']['mean']:.1f} ms after")
    assert after["num_steps"] != before["num_steps"]


def test_the_engines_chunking_rule_decides_the_simulated_step_count(monkeypatch):
    chunked = summary(run(_colocated(), COST, _trace()))
    # All of a request's tokens or none in a step (as with chunked prefill off).
    monkeypatch.setattr(engine.core.scheduler.Scheduler, "_tokens_now",
                        lambda self, num_tokens, budget: num_tokens if num_tokens <= budget else 0)
    whole = summary(run(_colocated(), COST, _trace()))
    assert whole["num_steps"] != chunked["num_steps"]
    assert whole["completed"] == 12


def test_the_engine_config_sizes_the_simulated_scheduler():
    topo = SimTopology(prefill_workers=0, decode_workers=1,
                       engine={"max_num_batched_tokens": 512, "max_num_seqs": 7, "num_kv_blocks": 300,
                               "enable_chunked_prefill": True, "preemption_mode": "swap"})
    (w,) = Simulator(topo, COST, []).pools["decode"]
    cfg = w.scheduler.config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.preemption_mode) == (512, 7, "swap")
    assert w.kv.pool.num_blocks == 300


def test_without_chunked_prefill_the_budget_grows_to_the_context_as_in_the_engine():
    topo = SimTopology(prefill_workers=0, decode_workers=1,
                       engine={"max_num_batched_tokens": 4096, "enable_chunked_prefill": False,
                               "max_model_len": 8192})
    (w,) = Simulator(topo, COST, []).pools["decode"]
    assert w.scheduler.config.max_num_batched_tokens == 8192
