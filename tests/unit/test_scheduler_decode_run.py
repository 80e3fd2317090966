"""A run of identical decode steps taken at once (``Scheduler.decode_run`` and
``skip_decode_steps``, the simulator's shortcut) leaves the scheduler and its block pool
exactly as the same steps taken one by one with ``schedule`` and ``update``.

Two schedulers are built and driven alike (same arrivals, same steps, a seeded block
hash) until a run of decode steps opens; one then steps through it, the other skips it,
and every request's counters and tokens, every block table, the free queue's order, the
prefix cache and the step count must agree.
"""

from __future__ import annotations

import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.core.block_hash import BlockHasher
from engine.core.block_pool import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.wire.sampling_params import SamplingParams

BS = 4
TOKEN = 7


def _pair(num_blocks: int, caching: bool, budget: int, max_len: int) -> list[Scheduler]:
    def one() -> Scheduler:
        kv = KVCacheManager(num_blocks, BS, enable_caching=caching, hasher=BlockHasher(seed=0))
        return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_len), kv)

    return [one(), one()]


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update(out, {s.request.request_id: TOKEN for s in out.scheduled if s.sample})


def _state(sched: Scheduler) -> dict:
    kv, pool = sched.kv_manager, sched.kv_manager.pool
    return {
        "requests": {rid: (r.num_computed_tokens, list(r.output_token_ids), r.status, kv.block_ids(rid))
                     for rid, r in sched.requests.items()},
        "running": [r.request_id for r in sched.running.in_order],
        "free_queue": [*range(len(pool.blocks), pool.num_blocks), *pool._free],
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        "cached": {h: b.block_id for h, b in pool._cached.items()},
        "hashed": dict(kv._num_hashed),
        "steps": sched.stats.num_steps,
    }


def _arrive(scheds: list[Scheduler], rng: random.Random, rid: str, prefixes: list[list[int]]) -> None:
    prompt = rng.choice(prefixes) + [rng.randrange(100, 10**6) for _ in range(rng.randrange(1, 20))]
    params = SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=True)
    for s in scheds:
        s.add_request(Request(rid, list(prompt), params))


@given(seed=st.integers(0, 10**6), num_blocks=st.integers(12, 80), caching=st.booleans(),
       cut=st.floats(0.0, 1.0))
@settings(max_examples=60, deadline=None)
def test_a_skipped_decode_run_equals_its_steps_one_by_one(seed, num_blocks, caching, cut):
    rng = random.Random(seed)
    a, b = _pair(num_blocks, caching, budget=64, max_len=96)
    # Shared leading blocks (and outputs of the same token) make prefix hits and
    # evictions happen inside runs.
    prefixes = [[], [rng.randrange(100, 10**6) for _ in range(2 * BS)], [TOKEN] * (3 * BS)]
    runs = 0  # how many runs were compared (hypothesis events)
    for i in range(40):
        if rng.random() < 0.5:
            _arrive([a, b], rng, str(i), prefixes)
        if not a.has_schedulable_work():
            continue
        run = a.decode_run(TOKEN)
        assert run == b.decode_run(TOKEN)
        if run:
            # A prefix of the run, as the simulator takes when something new arrives mid-run.
            k = max(1, round(cut * len(run)))
            for _ in range(k):
                _step(a)
            b.skip_decode_steps(k, TOKEN)
            assert _state(a) == _state(b), f"{k} skipped steps (of a run of {len(run)}) differ from stepping them"
            runs += 1
        _step(a)
        _step(b)
        assert _state(a) == _state(b)
    event(f"decode runs compared: {min(runs, 5)}{'+' if runs >= 5 else ''}")


def test_a_run_stops_before_a_request_ends_and_before_blocks_run_out():
    kv = KVCacheManager(8, BS, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=96), kv)
    sched.add_request(Request("a", list(range(100, 103)), SamplingParams(max_tokens=30, ignore_eos=True)))
    sched.add_request(Request("b", list(range(200, 203)), SamplingParams(max_tokens=5, ignore_eos=True)))
    _step(sched)  # both prompts computed, a first token each: 4 tokens in one block each
    run = sched.decode_run(TOKEN)
    # b has 4 tokens to go: three steps end nowhere, its fourth ends it.
    assert len(run) == 3, f"the run must end before b's last token, got {run}"
    # The first step computes position 3 (block 0 still), the second position 4 (a new block each).
    assert run == [0, 2, 2], f"the second decode step takes a block for each, got {run}"
    sched.skip_decode_steps(3, TOKEN)
    _step(sched)
    assert "b" not in sched.requests, "b finished in the step after the run"
    # a alone now: 8 tokens held in 2 blocks, 5 free; each run is bounded by the pool.
    run = sched.decode_run(TOKEN)
    assert run[-1] <= kv.pool.num_free_blocks and len(run) < 22, f"the run must stop at the pool's end: {run}"


def test_no_run_while_a_request_waits_or_prefills():
    kv = KVCacheManager(64, BS, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=96), kv)
    sched.add_request(Request("a", list(range(100, 110)), SamplingParams(max_tokens=30, ignore_eos=True)))
    assert sched.decode_run(TOKEN) == [], "a waiting request is no decode run"
    _step(sched)
    assert sched.decode_run(TOKEN) == [], "a chunked prompt still computing is no decode run"
    while sched.requests["a"].num_output_tokens == 0:
        _step(sched)
    assert sched.decode_run(TOKEN), "decoding alone is a run"
    stop = Request("s", list(range(300, 303)), SamplingParams(max_tokens=30, min_tokens=5, stop_token_ids=(TOKEN,)))
    sched.add_request(stop)
    _step(sched)
    assert sched.decode_run(TOKEN) == [], "a request that stops at the sampled token ends any run"
