"""The model runner's input as deltas (``engine.model.runner_input``), driven by the real scheduler
without a model: whatever the scheduler does (chunked prefill, prefix hits, preemption by
recompute or swap, a sliding window giving blocks back, aborts, KV from another worker), the
runner's copy of every request it computes equals the scheduler's, and it holds nothing once
the scheduler is idle."""

from __future__ import annotations

import random

import pytest

from engine.core.block_pool import NULL_BLOCK_ID, KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.model.runner_input import BlockTables, RunnerInputBuilder, RunnerRequests
from engine.wire.sampling_params import SamplingParams

BS = 4
EOS = 2


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,), sampling_seed=len(rid))


def _check_step(sched: Scheduler, plan, items, runner: RunnerRequests) -> None:
    """Every planned request reached the runner as the scheduler has it now."""
    assert len(items) == len(plan.scheduled)
    by_id = {r.request_id: (r, start, n) for r, start, n in items}
    for item in plan.scheduled:
        req = item.request
        mine, start, n = by_id[req.request_id]
        assert (start, n) == (item.start_pos, len(item.token_ids)), f"{req.request_id}: the step's tokens"
        assert mine.prompt_token_ids == req.prompt_token_ids and mine.output_token_ids == req.output_token_ids, (
            f"{req.request_id}: the runner's tokens differ from the scheduler's"
        )
        assert mine.token_slice(start, start + n) == item.token_ids
        assert mine.block_ids == item.block_ids, f"{req.request_id}: the runner's block table differs"
        row = runner.tables.array[mine.row]
        assert row[: len(item.block_ids)].tolist() == item.block_ids and not row[len(item.block_ids):].any(), (
            f"{req.request_id}: its row of the block-table array differs from its table")
        num_tokens = len(mine.prompt_token_ids) + len(mine.output_token_ids)
        assert (start + n == num_tokens) == item.sample, f"{req.request_id}: whether it samples"
        assert mine.sampling_params is req.sampling_params and mine.sampling_seed == req.sampling_seed


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_runners_copy_follows_the_scheduler_through_any_workload(mode, seed):
    rng = random.Random(seed)
    window = BS * rng.choice([0, 0, 2])
    kv = KVCacheManager(rng.randrange(12, 18), BS, enable_caching=rng.random() < 0.7, num_cpu_blocks=24,
                        window=window)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.randrange(4, 20), max_num_seqs=rng.randrange(4, 9),
                                      max_model_len=64, preemption_mode=mode), kv)
    builder, runner = RunnerInputBuilder(), RunnerRequests()
    shared = [rng.randrange(3, 50) for _ in range(12)]  # a common prefix, for prefix-cache hits
    seen = {"preempted": 0, "new again": 0, "released": 0, "remote": 0}
    sent_before: set[str] = set()
    for step in range(3000):
        if step < 150 and rng.random() < 0.4:
            rid = f"r{step}"
            prompt = shared[: rng.randrange(0, 12)] + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 16))]
            req = _request(rid, prompt, rng.randrange(1, 30))
            if rng.random() < 0.2:  # its KV comes from another worker, with the first token
                if sched.add_remote(req) is not None:
                    sched.remote_arrived(rid, rng.randrange(3, 50))
                    seen["remote"] += 1
            else:
                sched.add_request(req)
        if sched.requests and rng.random() < 0.05:  # an abort between steps
            for r in sched.finish_requests([rng.choice(sorted(sched.requests))], RequestStatus.FINISHED_ABORTED):
                builder.forget(r.request_id)
        plan = sched.schedule()
        step_input = builder.build(plan)
        seen["preempted"] += len(plan.preempted)
        seen["new again"] += sum(n.request_id in sent_before for n in step_input.new_requests)
        seen["released"] += sum(NULL_BLOCK_ID in n.block_ids for n in step_input.new_requests)
        seen["released"] += sum(bool(r) for r in step_input.cached_requests.num_released_blocks)
        sent_before |= {n.request_id for n in step_input.new_requests}
        items = runner.apply(step_input)
        _check_step(sched, plan, items, runner)
        for r in plan.finished:
            builder.forget(r.request_id)
        sampled = {s.request.request_id: EOS if rng.random() < 0.05 else rng.randrange(3, 50)
                   for s in plan.scheduled if s.sample}
        for r, _ in sched.update(plan, sampled):
            if r.is_finished:
                builder.forget(r.request_id)
        assert set(runner.requests) <= set(sched.requests) | set(builder._dropped), (
            "the runner holds a request the scheduler no longer has, and no drop is on its way")
        if step >= 150 and not sched.has_work():
            break
    assert not sched.has_work(), "the workload should have finished"
    runner.apply(builder.build(sched.schedule()))
    assert len(runner) == 0, f"the runner still holds {sorted(runner.requests)} after every request ended"
    assert not runner.tables.array.any(), "a table's row outlived its request"
    assert seen["preempted"] and seen["remote"], f"the workload missed a case: {seen}"
    if window:
        assert seen["released"], f"a window should have given blocks back: {seen}"


def test_a_decoding_request_is_sent_whole_once_then_only_its_new_token():
    kv = KVCacheManager(32, BS, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add_request(_request("a", list(range(10, 16)), max_tokens=8))
    builder = RunnerInputBuilder()
    first = builder.build(plan := sched.schedule())
    assert [n.request_id for n in first.new_requests] == ["a"] and not first.cached_requests.request_ids
    assert first.new_requests[0].prompt_token_ids == list(range(10, 16))
    assert first.new_requests[0].block_ids == kv.block_ids("a")
    sched.update(plan, {"a": 40})
    table = kv.block_ids("a")
    for token in (41, 42, 43):
        step = builder.build(plan := sched.schedule())
        assert not step.new_requests, "a request the runner holds is not sent again"
        c = step.cached_requests
        assert c.request_ids == ["a"] and c.num_scheduled_tokens == [1]
        assert c.new_token_ids == [[token - 1]], "the one token sampled last step, not the history"
        assert c.num_computed_tokens == [sched.requests["a"].num_tokens - 1]
        assert c.new_block_ids == [kv.block_ids("a")[len(table):]], "only a block the table gained"
        table = kv.block_ids("a")
        sched.update(plan, {"a": token})
    assert len(table) == 3, "the steps should have opened a third block"
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    builder.forget("a")
    assert builder.build(sched.schedule()).finished_ids == ["a"], "the runner is told to drop it"


def test_the_block_table_array_grows_in_rows_and_columns_and_gathers_padded_rows():
    tables = BlockTables(rows=2, columns=4)
    ids = [[i + 1] * (i + 1) for i in range(5)]  # table i: i + 1 blocks, each block i + 1
    rows = [tables.add(t) for t in ids]
    assert len(set(rows)) == 5, "each table gets a row of its own"
    tables.extend(rows[0], 1, list(range(50, 59)))  # past the 4 columns it started with
    got = tables.gather([rows[4], rows[0]], 12)
    assert got.tolist() == [[5] * 5 + [0] * 7, [1, *range(50, 59), 0, 0]], "rows cut or padded with block 0"
    assert tables.gather([rows[1]], 40).tolist() == [[2, 2] + [0] * 38], "columns no table reached are padding"
    tables.release(rows[4], 0, 2)
    assert tables.gather([rows[4]], 5).tolist() == [[NULL_BLOCK_ID] * 2 + [5] * 3]
    for row, t in zip(rows, ids):
        tables.drop(row, len(t) + (9 if row == rows[0] else 0))
    assert not tables.array.any() and tables.add([7]) in rows, "dropped rows are zeroed and reused"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_engine_leaves_its_runner_holding_nothing_once_its_requests_end(tiny_model, mode):
    """Through preemption (a pool too small for every request at once) and an abort: the step
    after the last request ends, the runner's copies and block-table rows are all gone."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(model=tiny_model, num_kv_blocks=14, block_size=4, max_num_batched_tokens=32,
                       preemption_mode=mode)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(list(range(3 + i, 13 + i)), params) for i in range(5)]
    engine.step()
    engine.abort(rids[-1])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_preemptions > 0, "the pool should have been too small for every request"
    assert len(engine.runner.requests) > 0, "the last requests' ends travel with the next step"
    engine.step()
    assert len(engine.runner.requests) == 0 and not engine.runner.requests.tables.array.any()
    assert engine.stats().num_blocks_in_use == 0
