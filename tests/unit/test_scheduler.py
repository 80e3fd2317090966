"""The token-budget scheduler, driven without a model.

Requests are built from integers, a ``KVCacheManager`` holds their blocks, and each
step's "model" is a dict of hand-made sampled tokens fed to ``update``. A property
test then throws random arrivals and aborts at small pools in every preemption mode.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.core.block_pool import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.wire.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
BS = 4
EOS = 2
TOKEN = 7  # what the fake model samples unless told otherwise (not EOS)


def _scheduler(num_blocks=64, num_cpu_blocks=64, caching=False, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching, num_cpu_blocks=num_cpu_blocks)
    return Scheduler(SchedulerConfig(**config), kv)


_next_token = iter(range(100, 10**9))


def _request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, **params) -> Request:
    # Distinct prompt tokens per request, so nothing hits the prefix cache by accident.
    prompt = [next(_next_token) for _ in range(prompt_len)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        priority=priority,
        eos_token_ids=(EOS,),
    )


def _step(sched: Scheduler, token: int = TOKEN, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    out = sched.schedule()
    tokens = tokens or {}
    sampled = {s.request.request_id: tokens.get(s.request.request_id, token) for s in out.scheduled if s.sample}
    sched.update(out, sampled)
    return out


def _planned(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: len(s.token_ids) for s in out.scheduled}


def _run_until_idle(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_work():
        assert len(outs) < max_steps, f"scheduler still busy after {max_steps} steps"
        outs.append(_step(sched))
    return outs


def _assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv_manager
    assert kv.pool.num_used_blocks == 0, f"{kv.pool.num_used_blocks} device blocks still in use"
    assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks, "swap space still in use"


# ------------------------------------------------------------------ purity


def test_scheduler_and_block_pool_import_without_torch():
    code = "import sys, engine.core.scheduler, engine.core.block_pool; assert 'torch' not in sys.modules"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"importing the scheduler must not import torch:\n{proc.stderr}"


# ------------------------------------------------------------------ budget and order


def test_each_step_stays_within_the_token_budget_and_max_num_seqs():
    sched = _scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    for i, n in enumerate([3, 30, 7, 12, 25, 1, 9, 16, 4, 20]):
        sched.add_request(_request(f"r{i}", n, max_tokens=5))
    outs = _run_until_idle(sched)
    for k, out in enumerate(outs):
        assert out.num_batched_tokens == sum(_planned(out).values())
        assert out.num_batched_tokens <= 16, f"step {k} planned {out.num_batched_tokens} > 16 tokens"
        assert len(out.scheduled) <= 3, f"step {k} ran {len(out.scheduled)} > max_num_seqs=3 requests"
    assert max(o.num_batched_tokens for o in outs) == 16, "long prompts should fill the budget"
    _assert_all_free(sched)


def test_running_requests_are_scheduled_before_waiting_ones():
    sched = _scheduler(max_num_batched_tokens=8)
    sched.add_request(_request("old", 4))
    _step(sched)  # "old" prefilled, now decoding
    sched.add_request(_request("new", 20))
    out = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["old", "new"]
    assert _planned(out) == {"old": 1, "new": 7}, (
        f"the running request's decode token comes first, the waiting one gets the rest; got {_planned(out)}"
    )


def test_waiting_request_gets_nothing_when_running_ones_use_the_budget():
    sched = _scheduler(max_num_batched_tokens=2)
    sched.add_request(_request("a", 1))
    sched.add_request(_request("b", 1))
    _step(sched)
    sched.add_request(_request("c", 1))
    out = _step(sched)
    assert _planned(out) == {"a": 1, "b": 1}, f"the 2-token budget goes to the running pair, got {_planned(out)}"


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_after_the_last_chunk():
    sched = _scheduler(max_num_batched_tokens=8)
    req = _request("long", 20)
    sched.add_request(req)
    chunks = [_step(sched).scheduled[0] for _ in range(3)]
    assert [(c.start_pos, len(c.token_ids)) for c in chunks] == [(0, 8), (8, 8), (16, 4)]
    assert [c.token_ids for c in chunks] == [req.prompt_token_ids[i : i + 8] for i in (0, 8, 16)]
    assert [c.sample for c in chunks] == [False, False, True], "only the last chunk samples"
    assert req.output_token_ids == [TOKEN], "one token sampled after the whole prompt"


def test_without_chunking_a_prompt_is_scheduled_whole():
    sched = _scheduler(
        max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    sched.add_request(_request("a", 20, max_tokens=3))
    sched.add_request(_request("b", 20, max_tokens=3))
    first = _step(sched)
    assert _planned(first) == {"a": 20}, (
        f"b does not fit the 12 tokens left and must wait rather than be split; got {_planned(first)}"
    )
    second = _step(sched)
    assert _planned(second) == {"a": 1, "b": 20}, f"b goes whole next step, got {_planned(second)}"


def test_chunked_prefill_does_split_the_same_workload():
    # The contrast to the test above: with chunking on, b starts in the first step.
    sched = _scheduler(max_num_batched_tokens=32, max_model_len=32)
    sched.add_request(_request("a", 20, max_tokens=3))
    sched.add_request(_request("b", 20, max_tokens=3))
    assert _planned(_step(sched)) == {"a": 20, "b": 12}


def test_a_finished_request_leaves_and_a_waiting_one_joins_the_next_step():
    sched = _scheduler(max_num_seqs=2)
    a, b, c = _request("a", 3, max_tokens=2), _request("b", 3, max_tokens=5), _request("c", 3)
    for r in (a, b, c):
        sched.add_request(r)
    assert _planned(_step(sched)) == {"a": 3, "b": 3}, "max_num_seqs=2 keeps c waiting"
    assert _planned(_step(sched)) == {"a": 1, "b": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 2
    assert sched.kv_manager.block_ids("a") == [], "a finished request frees its blocks at once"
    assert _planned(_step(sched)) == {"b": 1, "c": 3}, "c takes a's seat in the very next step"


def test_static_batching_keeps_the_seat_empty_until_the_whole_batch_ends():
    # The same workload as above: under static batching c waits for b as well.
    sched = _scheduler(max_num_seqs=2, batching="static")
    a, b, c = _request("a", 3, max_tokens=2), _request("b", 3, max_tokens=5), _request("c", 3)
    for r in (a, b, c):
        sched.add_request(r)
    assert _planned(_step(sched)) == {"a": 3, "b": 3}
    assert _planned(_step(sched)) == {"a": 1, "b": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH
    for _ in range(3):
        assert _planned(_step(sched)) == {"b": 1}, "no new request joins a running static batch"
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert _planned(_step(sched)) == {"c": 3}, "the next batch forms once the last one is done"
    _run_until_idle(sched)
    _assert_all_free(sched)


def test_static_batch_takes_more_prompts_than_one_steps_budget_and_computes_them_later():
    sched = _scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False, batching="static")
    for rid in "abc":
        sched.add_request(_request(rid, 20, max_tokens=2))
    assert _planned(_step(sched)) == {"a": 20}, "whole prompts only, within the budget"
    assert sched.num_waiting == 0 and len(sched.running) == 3, "but all three joined the batch"
    assert _planned(_step(sched)) == {"a": 1, "b": 20}
    assert _planned(_step(sched)) == {"b": 1, "c": 20}
    _run_until_idle(sched)
    _assert_all_free(sched)


def test_batching_mode_is_validated():
    with pytest.raises(ValueError, match="batching must be one of"):
        SchedulerConfig(batching="dynamic")


# ------------------------------------------------------------------ preemption


def _three_in_four_blocks(policy: str, mode: str = "recompute", **config):
    """a, b, c (4-token prompts, one block each) in a 4-block pool.

    After the first step each has 5 tokens and needs a second block, and only one
    block is free: the second request to ask must evict someone.
    """
    sched = _scheduler(num_blocks=5, policy=policy, preemption_mode=mode, **config)
    prios = {"a": 0, "b": 5, "c": 1}
    reqs = {rid: _request(rid, 4, max_tokens=3, priority=p) for rid, p in prios.items()}
    for r in reqs.values():
        sched.add_request(r)
    _step(sched)
    return sched, reqs


def test_fcfs_preempts_the_latest_arrived_running_request():
    sched, reqs = _three_in_four_blocks("fcfs")
    out = _step(sched)
    assert out.preempted == ["c"], f"c arrived last and should be the victim, got {out.preempted}"
    assert _planned(out) == {"a": 1, "b": 1}


def test_priority_policy_preempts_the_largest_priority_value():
    sched, reqs = _three_in_four_blocks("priority")
    out = _step(sched)
    assert out.preempted == ["b"], (
        f"b has priority 5 (least important) and should be the victim, got {out.preempted}"
    )
    assert _planned(out) == {"a": 1, "c": 1}


def test_recompute_sends_the_victim_to_the_front_of_the_queue_with_progress_reset():
    sched, reqs = _three_in_four_blocks("fcfs")
    late = _request("late", 4, max_tokens=1)
    sched.add_request(late)
    c = reqs["c"]
    out = _step(sched)
    assert out.preempted == ["c"] and not out.swap_out
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0, (
        f"a recomputed victim restarts from 0 computed tokens, got {c.num_computed_tokens}"
    )
    assert c.output_token_ids == [TOKEN], "its sampled output is kept"
    assert sched.kv_manager.block_ids("c") == [], "its blocks are freed"
    assert sched.stats.num_preemptions_recompute == 1
    admitted = []
    while not admitted:
        out = _step(sched)
        admitted = [s for s in out.scheduled if s.request.request_id in ("c", "late")]
    first = admitted[0]
    assert first.request is c, "the victim must be re-admitted before a request that arrived later"
    assert first.start_pos == 0 and len(first.token_ids) == 5, (
        "recompute reprocesses the prompt and the output token"
    )
    _run_until_idle(sched)
    assert c.status == RequestStatus.FINISHED_LENGTH and c.num_output_tokens == 3
    _assert_all_free(sched)


def test_swap_mode_swaps_the_victim_out_and_back_in():
    sched, reqs = _three_in_four_blocks("fcfs", mode="swap")
    c = reqs["c"]
    c_blocks = sched.kv_manager.block_ids("c")
    out = _step(sched)
    assert out.preempted == ["c"]
    assert [d for d, _ in out.swap_out] == c_blocks, f"swap_out should copy c's blocks {c_blocks}"
    assert c.status == RequestStatus.SWAPPED and c.num_computed_tokens == 4, (
        "a swapped victim keeps its computed tokens"
    )
    assert sched.stats.num_preemptions_swap == 1
    cpu = [cb for _, cb in out.swap_out]
    while True:
        out = _step(sched)
        assert not out.preempted or not out.swap_in, "no swap in during a step that preempts"
        if out.swap_in:
            break
    assert [cb for cb, _ in out.swap_in] == cpu, "swap_in reads back the cpu blocks swap_out wrote"
    assert [d for _, d in out.swap_in] == sched.kv_manager.block_ids("c")[: len(cpu)]
    (item,) = [s for s in out.scheduled if s.request is c]
    assert item.start_pos == 4 and len(item.token_ids) == 1, "a swapped-in request resumes decoding"
    _run_until_idle(sched)
    assert c.status == RequestStatus.FINISHED_LENGTH
    _assert_all_free(sched)


def _auto_victim(extra_blocks: int):
    """'a' (4-token prompt) and 'v' (20-token prompt) both need a new block every 4 steps.

    The pool holds both prompts plus ``extra_blocks``; the first time both cannot
    grow, v (arrived last) is preempted. Returns the scheduler, v and v's output count
    at that moment.
    """
    sched = _scheduler(num_blocks=1 + 1 + 5 + extra_blocks, preemption_mode="auto")
    v = _request("v", 20, max_tokens=12)
    sched.add_request(_request("a", 4, max_tokens=12))
    sched.add_request(v)
    for _ in range(20):
        n_out = v.num_output_tokens
        out = _step(sched)
        if out.preempted:
            assert out.preempted == ["v"]
            return sched, v, n_out
    pytest.fail("the pool should have run out")


def test_auto_mode_recomputes_a_victim_with_short_output():
    sched, v, n_out = _auto_victim(extra_blocks=1)
    assert n_out < 0.2 * v.num_prompt_tokens, "scenario: output under 20% of the prompt"
    assert sched.stats.num_preemptions_recompute == 1 and sched.stats.num_preemptions_swap == 0, (
        f"{n_out} output tokens on a 20-token prompt should be recomputed"
    )
    assert v.status == RequestStatus.WAITING


def test_auto_mode_swaps_a_victim_with_long_output():
    sched, v, n_out = _auto_victim(extra_blocks=3)
    assert n_out >= 0.2 * v.num_prompt_tokens, "scenario: output at least 20% of the prompt"
    assert sched.stats.num_preemptions_swap == 1 and sched.stats.num_preemptions_recompute == 0, (
        f"{n_out} output tokens on a 20-token prompt should be swapped"
    )
    assert v.status == RequestStatus.SWAPPED


def test_swap_falls_back_to_recompute_without_swap_space():
    sched = _scheduler(num_blocks=5, num_cpu_blocks=0, preemption_mode="swap")
    for rid in "abc":
        sched.add_request(_request(rid, 4, max_tokens=3))
    _step(sched)
    out = _step(sched)
    assert out.preempted == ["c"] and out.swap_out == []
    assert sched.requests["c"].status == RequestStatus.WAITING
    assert sched.stats.num_preemptions_recompute == 1


def test_a_request_that_outgrows_the_whole_pool_is_reported_finished():
    sched = _scheduler(num_blocks=3)  # 2 usable blocks: 8 tokens
    req = _request("big", 5, max_tokens=50)
    sched.add_request(req)
    finished_in = []
    for _ in range(20):
        out = _step(sched)
        finished_in += [r.request_id for r in out.finished]
        if not sched.has_work():
            break
    assert req.status == RequestStatus.FINISHED_LENGTH, f"got {req.status!r}"
    assert finished_in == ["big"], (
        "a request finished while planning must be reported in SchedulerOutput.finished"
    )
    assert req.num_tokens == 9, "it runs until its next token has no slot left"
    _assert_all_free(sched)


# ------------------------------------------------------------------ stopping


@pytest.mark.parametrize(
    "params, fed, status, n_out, stop_reason",
    [
        (dict(max_tokens=3), [TOKEN] * 5, RequestStatus.FINISHED_LENGTH, 3, None),
        (dict(max_tokens=9), [TOKEN, EOS, TOKEN], RequestStatus.FINISHED_STOPPED, 2, None),
        (dict(max_tokens=9, ignore_eos=True), [EOS, EOS, TOKEN], RequestStatus.FINISHED_LENGTH, 9, None),
        (dict(max_tokens=9, stop_token_ids=(11,)), [TOKEN, 11], RequestStatus.FINISHED_STOPPED, 2, 11),
        (dict(max_tokens=9, min_tokens=3), [EOS, EOS, EOS, TOKEN], RequestStatus.FINISHED_STOPPED, 3, None),
    ],
    ids=["max_tokens", "eos", "ignore_eos", "stop_token_ids", "min_tokens"],
)
def test_stop_conditions_finish_with_the_right_status_and_free_blocks(params, fed, status, n_out, stop_reason):
    sched = _scheduler()
    req = _request("r", 6, **params)
    sched.add_request(req)
    fed = iter(fed)
    for _ in range(20):
        if not sched.has_work():
            break
        _step(sched, token=next(fed, TOKEN))
    assert req.status == status, f"expected {status!r}, got {req.status!r}"
    assert req.num_output_tokens == n_out, f"expected {n_out} output tokens, got {req.output_token_ids}"
    assert req.stop_reason == stop_reason
    assert "r" not in sched.requests and sched.kv_manager.block_ids("r") == []
    _assert_all_free(sched)


def test_max_model_len_finishes_a_request_with_length():
    sched = _scheduler(max_model_len=10)
    req = _request("r", 6, max_tokens=100)
    sched.add_request(req)
    _run_until_idle(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 10


def test_finish_requests_aborts_from_waiting_running_and_swapped():
    sched, reqs = _three_in_four_blocks("fcfs", mode="swap", max_num_seqs=3)
    _step(sched)  # c swapped out
    sched.add_request(_request("w", 4))  # arrives after the last step: still waiting
    states = {rid: r.status for rid, r in sched.requests.items()}
    assert states["c"] == RequestStatus.SWAPPED
    assert {states["a"], states["b"]} == {RequestStatus.RUNNING}
    assert states["w"] == RequestStatus.WAITING
    done = sched.finish_requests(["a", "c", "w", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in done) == ["a", "b", "c", "w"], "unknown ids are ignored"
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert not sched.has_work() and not sched.running and not sched.swapped and sched.num_waiting == 0
    _assert_all_free(sched)
    assert sched.schedule().is_empty, "nothing is left to schedule"


def test_abort_while_a_step_runs_drops_its_result():
    sched = _scheduler()
    req = _request("r", 4)
    sched.add_request(req)
    out = sched.schedule()
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    results = sched.update(out, {"r": TOKEN})
    assert results == [] and req.output_token_ids == [], "an aborted request takes no token"
    _assert_all_free(sched)


# ------------------------------------------------------------------ property test

MODES = ("recompute", "swap", "auto")


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 8))
    reqs = [
        dict(
            arrival=draw(st.integers(0, 12)),
            prompt_len=draw(st.integers(1, 24)),
            max_tokens=draw(st.integers(1, 16)),
            priority=draw(st.integers(0, 3)),
        )
        for _ in range(n)
    ]
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, n - 1), st.booleans()), max_size=3))
    return dict(
        requests=reqs,
        aborts=aborts,
        budget=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 6)),
        pool_slack=draw(st.integers(-2, 3)),
        num_cpu_blocks=draw(st.integers(0, 16)),
        caching=draw(st.booleans()),
        batching=draw(st.sampled_from(["continuous", "static"])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
def test_random_workloads_respect_limits_and_finish(mode, policy, chunked, w):
    rng = random.Random(w["seed"])
    specs = w["requests"]
    longest = max(s["prompt_len"] + s["max_tokens"] for s in specs)
    longest_prompt = max(s["prompt_len"] for s in specs)
    # Enough blocks for the longest request's whole life, give or take a few; never
    # fewer than its prompt needs (the engine rejects prompts the pool cannot hold).
    need = -(-longest // BS)
    usable = max(need + w["pool_slack"], -(-(longest_prompt + 1) // BS))
    max_model_len = longest + 1
    budget = w["budget"] if chunked else max(w["budget"], max_model_len)
    sched = _scheduler(
        num_blocks=usable + 1,
        num_cpu_blocks=w["num_cpu_blocks"],
        caching=w["caching"],
        max_num_batched_tokens=budget,
        max_num_seqs=w["max_num_seqs"],
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        policy=policy,
        batching=w["batching"],
    )
    pool = sched.kv_manager.pool
    shared = [rng.randrange(3, 6) for _ in range(12)]  # a common prefix for cache hits
    requests = []
    for i, s in enumerate(specs):
        prompt = (shared + [rng.randrange(3, 50) for _ in range(24)])[: s["prompt_len"]]
        requests.append(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=s["max_tokens"]),
                priority=s["priority"],
                eos_token_ids=(EOS,),
            )
        )
    reported: list[str] = []  # every finish, as the engine would learn of it
    max_steps = 10 * sum(s["prompt_len"] + s["max_tokens"] for s in specs) + 50
    step = 0
    while step <= max(s["arrival"] for s in specs) or sched.has_work():
        assert step < max_steps, f"requests still unfinished after {step} steps: {sorted(sched.requests)}"
        for req, s in zip(requests, specs):
            if s["arrival"] == step:
                sched.add_request(req)
        mid_step_aborts = []
        for at, idx, mid in w["aborts"]:
            rid = f"r{idx}"
            if at == step and rid in sched.requests:
                if mid:
                    mid_step_aborts.append(rid)
                else:
                    reported += [r.request_id for r in sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)]

        hits_before = sched.kv_manager.stats.hits
        out = sched.schedule()
        assert out.num_batched_tokens == sum(len(x.token_ids) for x in out.scheduled)
        assert out.num_batched_tokens <= budget, f"step {step}: {out.num_batched_tokens} > budget {budget}"
        assert len(out.scheduled) <= w["max_num_seqs"] and len(sched.running) <= w["max_num_seqs"]
        assert not (out.swap_in and out.swap_out), "swap in and out never share a step"
        in_use = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert in_use == pool.num_used_blocks <= pool.num_usable_blocks
        for item in out.scheduled:
            req = item.request
            end = item.start_pos + len(item.token_ids)
            assert len(item.token_ids) >= 1, f"{req.request_id} was planned with no tokens"
            assert item.token_ids == req.all_token_ids[item.start_pos : end]
            assert item.start_pos == req.num_computed_tokens, "a step resumes where the last one ended"
            assert len(item.block_ids) * BS >= end and 0 not in item.block_ids
            for b in item.block_ids[item.start_pos // BS : -(-end // BS)]:
                assert pool.blocks[b].ref_cnt == 1, (
                    f"{req.request_id} writes into block {b}, which another request shares"
                )
            if not chunked and item.start_pos == 0:
                assert end == req.num_tokens, "without chunking a prefill is never split"
        reported += [r.request_id for r in out.finished]
        for what, happened in (
            ("preempted", out.preempted),
            ("swapped out", out.swap_out),
            ("swapped in", out.swap_in),
            ("outgrew the pool", out.finished),
            ("prefix hit", sched.kv_manager.stats.hits > hits_before),
        ):
            if happened:
                event(what)  # coverage notes for --hypothesis-show-statistics

        if mid_step_aborts:
            reported += [
                r.request_id for r in sched.finish_requests(mid_step_aborts, RequestStatus.FINISHED_ABORTED)
            ]
        sampled = {
            x.request.request_id: (EOS if rng.random() < 0.05 else rng.randrange(3, 50))
            for x in out.scheduled
            if x.sample
        }
        for req, _ in sched.update(out, sampled):
            if req.is_finished:
                reported.append(req.request_id)
        step += 1

    assert sorted(reported) == sorted(r.request_id for r in requests), (
        f"every request must be reported finished exactly once, got {sorted(reported)}"
    )
    for req, s in zip(requests, specs):
        assert req.is_finished and req.num_output_tokens <= s["max_tokens"]
        if req.status == RequestStatus.FINISHED_STOPPED:
            assert req.output_token_ids[-1] == EOS
    assert pool.num_used_blocks == 0, f"{pool.num_used_blocks} blocks leaked"
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.kv_manager.cpu_pool.num_free_blocks == w["num_cpu_blocks"], "swap blocks leaked"


def test_a_swapped_request_stays_swapped_while_the_pool_cannot_take_it_back():
    sched, reqs = _three_in_four_blocks("fcfs", mode="swap")
    assert _step(sched).preempted == ["c"]
    # a and b hold all four blocks; c must wait, swapped out, without breaking the step.
    out = _step(sched)
    assert not out.swap_in and reqs["c"].status == RequestStatus.SWAPPED, "no room: c stays swapped"
    assert sched.kv_manager.block_ids("c") == [], "a swap in that cannot happen takes no blocks"
    _run_until_idle(sched)
    assert reqs["c"].status == RequestStatus.FINISHED_LENGTH
    _assert_all_free(sched)


def test_prefix_cache_counts_the_tokens_of_each_admitted_request_and_its_hits():
    sched = _scheduler(num_blocks=64, caching=True, max_num_batched_tokens=8)
    prompt = list(range(100, 112))  # three blocks
    first, second = (Request(rid, prompt, SamplingParams(max_tokens=1)) for rid in ("first", "second"))
    sched.add_request(first)
    _run_until_idle(sched)
    sched.add_request(second)
    _run_until_idle(sched)
    stats = sched.kv_manager.stats
    assert (stats.queries, stats.hits) == (24, 8), (
        f"two 12-token prompts looked up and the second served 2 full blocks (capped below "
        f"its last token) from the cache: expected (24, 8), got {(stats.queries, stats.hits)}"
    )
    _assert_all_free(sched)
