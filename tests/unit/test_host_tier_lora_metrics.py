"""The host KV tier's and LoRA's counters, from the engine to a scrape: ``LLMEngine.stats()``
names the resident adapters and counts their loads and evictions, ``EngineMetrics`` exports
the tier's and LoRA's ``EngineStats`` fields as ``tandem:`` gauges and counters (each step
adds only what changed), and docs/metrics.md lists every metric the service defines."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

import engine.wire.metrics as metrics
from engine import LLM, SamplingParams
from engine.llm_engine import EngineStats
from engine.wire.metrics import EngineMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
IDLE = EngineStats(num_running=0, num_waiting=0, num_swapped=0, num_blocks=64, num_blocks_in_use=0,
                   kv_cache_usage=0.0, num_preemptions=0, num_preemptions_recompute=0, num_preemptions_swap=0,
                   prefix_cache_queries=0, prefix_cache_hits=0, num_steps=0, prompt_tokens=0, generation_tokens=0)


def _sample(name: str, worker: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": "m", "role": "decode", "worker": worker})


def _exported(worker: str) -> dict[str, float | None]:
    names = ("host_cache_blocks", "host_cache_blocks_used", "host_cache_hits_total", "host_cache_spills_total",
             "host_cache_restores_total", "lora_resident", "lora_loads_total", "lora_evictions_total")
    return {name: _sample(f"tandem:{name}", worker) for name in names}


def test_each_step_exports_the_host_tiers_and_loras_levels_and_adds_what_their_totals_gained():
    exporter = EngineMetrics("m", "decode", "tier-lora-0")
    first = dataclasses.replace(IDLE, host_cache_blocks=4096, host_cache_blocks_used=10, host_cache_spills=12,
                                host_cache_restores=3, host_cache_hits=48, lora_resident_adapters=("sql", "chat"),
                                lora_loads=2, lora_evictions=0)
    exporter.on_step(first)
    assert _exported("tier-lora-0") == {
        "host_cache_blocks": 4096, "host_cache_blocks_used": 10, "host_cache_hits_total": 48,
        "host_cache_spills_total": 12, "host_cache_restores_total": 3, "lora_resident": 2, "lora_loads_total": 2,
        "lora_evictions_total": 0}
    later = dataclasses.replace(first, host_cache_blocks_used=4, host_cache_spills=20, host_cache_hits=80,
                                lora_resident_adapters=("tools",), lora_loads=3, lora_evictions=2)
    exporter.on_step(later)
    exporter.on_step(later)  # nothing changed: nothing added twice
    assert _exported("tier-lora-0") == {
        "host_cache_blocks": 4096, "host_cache_blocks_used": 4, "host_cache_hits_total": 80,
        "host_cache_spills_total": 20, "host_cache_restores_total": 3, "lora_resident": 1, "lora_loads_total": 3,
        "lora_evictions_total": 2}


def test_an_engine_without_a_tier_or_adapters_exports_zeros():
    EngineMetrics("m", "decode", "tier-lora-1").on_step(IDLE)
    assert set(_exported("tier-lora-1").values()) == {0.0}


def test_the_host_tiers_hit_rate_is_its_share_of_what_the_device_missed():
    stats = dataclasses.replace(IDLE, prefix_cache_queries=1000, prefix_cache_hits=700, host_cache_hits=300)
    assert stats.host_cache_hit_rate == 0.5, "the device missed 600 tokens (1000 - 400); the tier served 300"


def test_the_engines_stats_name_its_resident_adapters_and_count_loads_and_evictions(tiny_model, tmp_path):
    """One slot, three turns: sql, chat, sql. Each turn writes its adapter into the slot and,
    past the first, pushes the other out."""
    from tests.unit.test_lora import make_adapter

    paths = {name: tmp_path / name for name in ("sql", "chat")}
    for seed, path in enumerate(paths.values()):
        make_adapter(tiny_model, path, 4, 8, ["q_proj", "v_proj"], False, seed=seed)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with LLM(model=tiny_model, max_loras=1, lora_adapters={k: str(v) for k, v in paths.items()}) as llm:
        before = llm.stats()
        for name in ("sql", "chat", "sql"):
            llm.generate([[5, 6, 7, 8]], params, adapter=name)
        after = llm.stats()
    assert (before.lora_resident_adapters, before.lora_loads, before.lora_evictions) == ((), 0, 0)
    assert (after.lora_resident_adapters, after.lora_resident) == (("sql",), 1)
    assert (after.lora_loads, after.lora_evictions) == (3, 2)
    with LLM(model=tiny_model) as llm:
        plain = llm.stats()
    assert (plain.lora_resident_adapters, plain.lora_loads, plain.lora_evictions) == ((), 0, 0)


def test_docs_list_every_metric_the_service_defines():
    page = DOCS.read_text()
    listed = set(re.findall(r"`([a-z0-9_]+)`", page))
    defined = {m._name.removeprefix("tandem:") for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)}
    assert defined <= listed, f"metrics docs/metrics.md does not list: {sorted(defined - listed)}"
