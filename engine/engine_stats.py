"""What an engine says about itself: its load now and its running totals.

``EngineLoad`` is how busy the engine is, in counts (what a worker's load report is made
of); ``EngineStats`` is that load plus the totals since the engine was built or reset
(preemptions, prefix cache, host tier, LoRA, steps, tokens, model-runner time), for
metrics and worker stats. ``StepTotals`` holds the totals only the engine's step loop
counts; the rest are read off the parts that count them (the scheduler, the block
manager and its host tier, the LoRA slots). ``LLMEngine.load`` and ``LLMEngine.stats``
(``engine.llm_engine``) assemble them here; both dataclasses stay importable from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.request import Request

if TYPE_CHECKING:
    from engine.core.block_pool import KVCacheManager
    from engine.core.scheduler import Scheduler
    from engine.model.lora import LoRASlots
    from engine.remote_kv import RemoteKVIntake
    from engine.structured_output import GrammarPen

__all__ = ["EngineLoad", "EngineStats", "StepTotals", "engine_load", "engine_stats"]


@dataclass
class EngineStats:
    """The engine's load plus running totals since it was built (preemptions, prefix cache, steps,
    tokens, model-runner time): what ``stats()`` returns for metrics and worker stats."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_blocks_in_use: int
    kv_cache_usage: float
    num_preemptions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    prompt_tokens: int
    generation_tokens: int
    # Time in the model runner (inputs, forward, sampling) over all steps: wall clock,
    # and CPU of the step thread (below the wall clock when the step waited for a core).
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0
    num_window_released_blocks: int = 0  # blocks given back from behind a sliding window
    # The host tier behind the prefix cache (EngineConfig.host_kv_cache_memory), in blocks:
    # its size, its entries now, the evicted blocks copied into it and those restored
    # from it (hits), and the prompt tokens those hits served.
    host_cache_blocks: int = 0
    host_cache_blocks_used: int = 0
    host_cache_spills: int = 0
    host_cache_restores: int = 0
    host_cache_hits: int = 0
    # LoRA (EngineConfig.max_loras): the adapters in a device slot now, by name, least
    # recently used first, and the adapters written into a slot and pushed out of one so far.
    lora_resident_adapters: tuple[str, ...] = ()
    lora_loads: int = 0
    lora_evictions: int = 0

    @property
    def host_cache_hit_rate(self) -> float:
        """Of the admitted prompt tokens the device's cache missed, the share the host tier served."""
        missed = self.prefix_cache_queries - (self.prefix_cache_hits - self.host_cache_hits)
        return self.host_cache_hits / missed if missed else 0.0

    @property
    def lora_resident(self) -> int:
        """The LoRA adapters in a device slot now."""
        return len(self.lora_resident_adapters)


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is now, in counts: what a worker's load report is made of."""

    num_running: int
    num_waiting: int  # to be scheduled (their grammar may still be compiling)
    num_swapped: int
    num_waiting_for_kv: int  # blocks reserved, KV on its way from another worker
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass
class StepTotals:
    """The totals the engine's step loop counts itself, since it was built or reset: prompt
    tokens taken in, tokens generated (a first token sampled elsewhere included), and the
    time in the model runner (wall clock and the step thread's CPU)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0


def engine_load(
    scheduler: Scheduler, kv_manager: KVCacheManager, pen: GrammarPen, remote_kv: RemoteKVIntake
) -> EngineLoad:
    """The load of an engine over these parts now (``waiting`` counts the new requests the
    pen holds while their grammar compiles)."""
    pool = kv_manager.pool
    return EngineLoad(
        num_running=len(scheduler.running),
        num_waiting=scheduler.num_waiting + len(pen.held(Request)),
        num_swapped=len(scheduler.swapped),
        num_waiting_for_kv=remote_kv.num_waiting,
        num_free_blocks=pool.num_free_blocks,
        num_blocks=pool.num_usable_blocks,
        prefix_cache_queries=kv_manager.stats.queries,
        prefix_cache_hits=kv_manager.stats.hits,
    )


def engine_stats(
    load: EngineLoad, scheduler: Scheduler, kv_manager: KVCacheManager, lora: LoRASlots | None, totals: StepTotals
) -> EngineStats:
    """``load`` plus the running totals of the parts that count them and of ``totals``."""
    steps, pool = scheduler.stats, kv_manager.pool
    names = {adapter.key: name for name, adapter in lora.loaded.items()} if lora is not None else {}
    return EngineStats(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_swapped=load.num_swapped,
        num_blocks=load.num_blocks,
        num_blocks_in_use=pool.num_used_blocks,
        kv_cache_usage=pool.usage,
        num_preemptions=steps.num_preemptions,
        num_preemptions_recompute=steps.num_preemptions_recompute,
        num_preemptions_swap=steps.num_preemptions_swap,
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
        num_steps=steps.num_steps,
        prompt_tokens=totals.prompt_tokens,
        generation_tokens=totals.generation_tokens,
        forward_s=totals.forward_s,
        forward_cpu_s=totals.forward_cpu_s,
        num_window_released_blocks=kv_manager.num_released,
        host_cache_blocks=kv_manager.host_tier.capacity,
        host_cache_blocks_used=kv_manager.host_tier.num_entries,
        host_cache_spills=kv_manager.host_tier.stats.spills,
        host_cache_restores=kv_manager.host_tier.stats.restores,
        host_cache_hits=kv_manager.stats.host_hits,
        lora_resident_adapters=tuple(names[key] for key in lora.resident) if lora is not None else (),
        lora_loads=lora.loads if lora is not None else 0,
        lora_evictions=lora.evictions if lora is not None else 0,
    )
