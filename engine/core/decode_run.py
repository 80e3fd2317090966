"""Runs of identical pure decode steps, counted and taken at once: the simulator's shortcut.

``engine.core.scheduler.Scheduler.decode_run`` and ``Scheduler.skip_decode_steps`` call
these with their running requests, KV cache manager (``engine.core.block_pool``) and
config (``engine.core.scheduler_plan``); the simulator (``sim.simulator``) uses those two
methods to time a decode worker's run of steps at once instead of one plan at a time.
``run_blocks`` says how long a run can be and what blocks it takes; ``take_run`` leaves
the requests and the KV cache manager as ``Scheduler.schedule`` and ``Scheduler.update``
would, step by step (``tests/unit/test_scheduler_decode_run.py`` compares the two).
Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.block_pool import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler_plan import SchedulerConfig


def run_blocks(running: Sequence[Request], kv: KVCacheManager, config: SchedulerConfig, token: int) -> list[int]:
    """The blocks a run of pure decode steps of ``running`` takes (nothing waits or is
    swapped out: the caller checks): entry j is what steps 1 to j + 1 allocate in all;
    empty when the next step is not one (see ``Scheduler.decode_run``)."""
    if not running or kv.window or len(running) > config.max_num_batched_tokens:
        return []
    steps = config.max_model_len
    for request in running:
        params, num_tokens = request.sampling_params, request.num_tokens
        if (request.num_computed_tokens != num_tokens - 1 or token in params.stop_token_ids
                or (not params.ignore_eos and token in request.eos_token_ids)):
            return []
        ends_in = min(params.max_tokens - request.num_output_tokens, config.max_model_len - num_tokens)
        steps = min(steps, ends_in - 1)
    if steps <= 0:
        return []
    bs = kv.block_size
    taken = [0] * (steps + 1)
    for request in running:
        # A new block when a step computes the first token past the table's end.
        for j in range(kv.num_table_blocks(request.request_id) * bs - request.num_computed_tokens, steps, bs):
            taken[j] += 1
    free, total, run = kv.pool.num_free_blocks, 0, []
    for n in taken[:steps]:
        total += n
        if total > free:
            break
        run.append(total)
    return run


def take_run(running: list[Request], kv: KVCacheManager, num_steps: int, token: int) -> None:
    """Take ``num_steps`` steps of a run at once, each request of ``running`` sampling
    ``token`` every step: the blocks allocated and cached in the order the steps would
    take them (step by step, each step's allocations before its caching, in running order)."""
    bs = kv.block_size
    start = [request.num_computed_tokens for request in running]
    events: list[tuple[int, int, int]] = []  # (step, 0 allocate / 1 cache, position)
    for pos, request in enumerate(running):
        c = start[pos]
        events.extend((j, 0, pos) for j in range(kv.num_table_blocks(request.request_id) * bs - c + 1,
                                                  num_steps + 1, bs))
        if kv.enable_caching:
            events.extend((j, 1, pos) for j in range(bs - c % bs, num_steps + 1, bs))
        request.output_token_ids.extend([token] * num_steps)
    events.sort()
    for j, phase, pos in events:
        request = running[pos]
        if phase == 0:
            request.num_computed_tokens = start[pos] + j - 1
            allocated = kv.allocate_slots(request, 1)
            assert allocated is not None, "decode_run counted the blocks"
        else:
            request.num_computed_tokens = start[pos] + j
            kv.cache_blocks(request)
    for pos, request in enumerate(running):
        request.num_computed_tokens = start[pos] + num_steps
