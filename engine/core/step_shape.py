"""What a step computes, read off the scheduler's plan: the terms a step's time depends on.

The simulator's cost model prices a ``StepShape`` (``sim.cost``); ``bench.steps`` times
steps of known shapes on an engine alone, and a serving engine can record the shape and
time of every step it takes (``AsyncEngine.record_steps``): both write the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """One step's work."""

    batch: int = 0  # requests in the step
    num_tokens: int = 0  # tokens computed
    prefill_tokens: int = 0  # of those, in chunks of more than one token
    attn_pairs: int = 0  # (query, key) pairs: a chunk of n from position s has n*s + n(n+1)/2
    kv_read_tokens: int = 0  # KV tokens the step's attention reads (context plus new)
    num_sampled: int = 0  # tokens sampled (the LM head's rows)
    swap_blocks: int = 0  # blocks copied to or from swap space


def shape_of(out) -> StepShape:
    """The ``StepShape`` of an ``engine.core.scheduler.SchedulerOutput``."""
    batch = tokens = prefill = pairs = kv = sampled = 0
    for item in out.scheduled:
        n, start = len(item.token_ids), item.start_pos
        batch += 1
        tokens += n
        if n > 1:
            prefill += n
        pairs += n * start + n * (n + 1) // 2
        kv += start + n
        sampled += item.sample
    return StepShape(batch, tokens, prefill, pairs, kv, sampled, len(out.swap_in) + len(out.swap_out))
