"""The host tier behind the prefix cache (``engine.core.host_tier``).

Pure level, no torch: the tier's LRU and pins, evicted blocks spilled by the block pool,
prefix lookups that go on in the tier and restore into fresh device blocks, swap and the
tier sharing one host pool, and the step plan's order. That order is checked by running
the scheduler's plans on ``KVContents``, which stands for the KV tensors: each slot of a
device or host block names the prefix its KV was computed from, a step copies as the
model runner does (every ``swap_out`` pair, then every ``swap_in`` pair, then the
forward), and every slot a request reads must name its own prefix.

With torch: greedy outputs equal transformers' with the tier on, on workloads whose
prefixes pass through a device pool a fraction of their size, with swap preemption
sharing the host pool, and every block comes back.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.block_hash import BlockHasher
from engine.core.block_pool import KVBlock, KVCacheManager
from engine.core.host_tier import CpuBlockPool, HostHit, HostTier
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.wire.sampling_params import SamplingParams

BS = 4


def _hash(i: int) -> bytes:
    return i.to_bytes(4, "big")


def _request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), eos_token_ids=(2,))


def _manager(num_blocks: int = 9, num_cpu_blocks: int = 16, host_cache_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, num_cpu_blocks=num_cpu_blocks, hasher=BlockHasher(seed=1),
                          host_cache_blocks=host_cache_blocks)


def _compute(kv: KVCacheManager, request: Request) -> list[int]:
    """Let a new request in with its prefix hit, compute its prompt and cache its blocks."""
    hit, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hit) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return kv.block_ids(request.request_id)


def _plan(kv: KVCacheManager) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """What one step's plan would carry of the tier's copies; the step then runs."""
    copies = kv.take_copies()
    kv.begin_step()
    return copies


# ------------------------------------------------------------------ the tier alone


def test_a_full_tier_drops_its_least_recently_used_entry():
    tier = HostTier(CpuBlockPool(2), capacity=2)
    tier.spill(5, _hash(1))
    tier.spill(6, _hash(2))
    tier.take_copies()
    tier.begin_step()
    tier.pin(_hash(1))  # used: 2 is now the least recently used
    tier.take_copies()
    tier.begin_step()
    tier.spill(7, _hash(3))
    assert tier.holds(_hash(1)) and tier.holds(_hash(3)), "the entries used last stay"
    assert not tier.holds(_hash(2)), "the least recently used entry gives way to the new one"
    assert tier.stats.dropped == 1 and tier.num_entries == 2


def test_spilling_a_prefix_the_tier_holds_copies_nothing():
    tier = HostTier(CpuBlockPool(4), capacity=4)
    tier.spill(5, _hash(1))
    tier.spill(9, _hash(1))
    spills, _ = tier.take_copies()
    assert spills == [(5, spills[0][1])], f"one copy for one prefix, got {spills}"
    assert tier.stats.spills == 1 and tier.num_entries == 1


def test_entries_a_plan_spills_or_restores_are_not_dropped_before_it_runs():
    tier = HostTier(CpuBlockPool(2), capacity=2)
    tier.spill(5, _hash(1))
    tier.spill(6, _hash(2))
    tier.spill(7, _hash(3))  # same plan: both entries are being written
    assert not tier.holds(_hash(3)) and tier.stats.lost == 1, "a full tier of pinned entries keeps them"
    tier.take_copies()
    tier.spill(8, _hash(4))  # the next plan is made before begin_step: still pinned
    assert tier.stats.lost == 2 and tier.holds(_hash(1)) and tier.holds(_hash(2))
    tier.take_copies()
    tier.begin_step()
    host = tier.pin(_hash(1))  # a restore in this plan reads entry 1
    tier.spill(9, _hash(5))
    assert tier.holds(_hash(1)) and not tier.holds(_hash(2)), "the unpinned entry goes, not the one being read"
    spills, _ = tier.take_copies()
    assert spills == [(9, spills[0][1])] and spills[0][1] != host, "the new entry never takes a block being read"


def test_swap_takes_the_tiers_blocks_but_the_tier_never_takes_swaps():
    tier = HostTier(CpuBlockPool(4), capacity=4)
    for i in range(4):
        tier.spill(10 + i, _hash(i))
    tier.take_copies()
    tier.begin_step()
    swap = tier.take_swap(3)
    assert swap is not None and len(swap) == 3, "entries give way to swap"
    assert tier.num_entries == 1 and tier.holds(_hash(3)), "the least recently used ones first"
    tier.spill(20, _hash(9))
    assert tier.host_pool.num_free_blocks == 0 and set(swap).isdisjoint({h for _, h in tier.take_copies()[0]})
    tier.begin_step()
    assert tier.take_swap(2) is None and tier.num_entries == 1, "a swap that cannot fit drops nothing"


def test_a_capacity_beyond_the_host_pool_is_refused():
    with pytest.raises(ValueError, match=r"host tier capacity must be in \[0, 4\]"):
        HostTier(CpuBlockPool(4), capacity=5)
    with pytest.raises(ValueError, match="host_cache_blocks|capacity"):
        KVCacheManager(8, BS, num_cpu_blocks=2, host_cache_blocks=3)


# ------------------------------------------------------------------ spill and restore


def test_an_evicted_prefix_block_is_spilled_and_a_lookup_goes_on_in_the_tier():
    kv = _manager(num_blocks=5)  # 4 usable blocks
    a = _request("a", list(range(100, 113)))  # 3 full blocks + 1 token
    table = _compute(kv, a)
    kv.free(a)
    _plan(kv)
    b = _request("b", list(range(200, 216)))  # 4 blocks: evicts all of a's
    _compute(kv, b)
    spills, restores = _plan(kv)
    assert sorted(d for d, _ in spills) == sorted(table[:3]), f"a's 3 hashed blocks spill, got {spills}"
    assert not restores and kv.host_tier.num_entries == 3
    kv.free(b)
    again = _request("a2", list(range(100, 113)) + [7])
    hit, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 12 and all(isinstance(h, HostHit) for h in hit), f"3 blocks from the tier, got {hit}"


def test_restored_blocks_take_fresh_device_blocks_are_hashed_again_and_keep_their_entry():
    kv = _manager(num_blocks=5)
    a = _request("a", list(range(100, 113)))
    _compute(kv, a)
    kv.free(a)
    _plan(kv)
    _compute(kv, b := _request("b", list(range(200, 216))))
    kv.free(b)
    spills, _ = _plan(kv)
    host_of = {d: h for d, h in spills}
    again = _request("a2", list(range(100, 113)) + [7])
    table = _compute(kv, again)
    _, restores = _plan(kv)
    assert [d for _, d in restores] == table[:3], "each restored block is where the table reads it"
    assert sorted(h for h, _ in restores) == sorted(host_of.values()), "read from the blocks spilled"
    assert kv.stats.host_hits == 0, "counted by the scheduler when it lets the request in"
    probe = _request("p", list(range(100, 113)) + [8])
    hit, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 12 and all(isinstance(h, KVBlock) for h in hit), "a later request hits them on the device"
    assert all(kv.host_tier.holds(h) for h in kv._block_hashes(again)[:3]), "the host copies stay"
    kv.free(again)
    spills_before = kv.host_tier.stats.spills
    _compute(kv, c := _request("c", list(range(300, 316))))
    assert _plan(kv)[0] == [] and kv.host_tier.stats.spills == spills_before, (
        "evicting restored blocks copies nothing: the tier holds their prefixes")
    kv.free(c)


def test_a_lookup_takes_whole_blocks_and_leaves_one_token_to_compute():
    kv = _manager(num_blocks=5)
    a = _request("a", list(range(100, 116)))  # exactly 4 blocks
    _compute(kv, a)
    kv.free(a)
    _plan(kv)
    _compute(kv, b := _request("b", list(range(200, 216))))
    kv.free(b)
    _plan(kv)
    hit, num_hit = kv.get_computed_blocks(_request("a2", list(range(100, 116))))
    assert num_hit == 12, "the last block would leave no token to compute: 3 of 4"
    hit, num_hit = kv.get_computed_blocks(_request("a3", list(range(100, 114))))
    assert num_hit == 12, "a part of a block never hits"
    hit, num_hit = kv.get_computed_blocks(_request("lp", list(range(100, 116)) + [1], prompt_logprobs=1))
    assert (hit, num_hit) == ([], 0), "a request that wants prompt logprobs computes every token"


def test_without_the_tier_an_evicted_prefix_is_gone():
    kv = _manager(num_blocks=5, host_cache_blocks=0)
    _compute(kv, a := _request("a", list(range(100, 113))))
    kv.free(a)
    _compute(kv, b := _request("b", list(range(200, 216))))
    kv.free(b)
    assert kv.take_copies() == ([], []) and kv.get_computed_blocks(_request("a2", list(range(100, 114))))[1] == 0


def test_a_decode_reservation_neither_spills_nor_restores():
    kv = _manager(num_blocks=5)
    _compute(kv, a := _request("a", list(range(100, 113))))
    kv.free(a)
    _plan(kv)
    assert kv.reserve_remote(_request("r", list(range(200, 216))), []) == 0
    assert kv.take_copies() == ([], []) and kv.host_tier.num_entries == 0, "the KV lands before a plan would copy"


# ------------------------------------------------------------------ the plan's order


class KVContents:
    """The KV tensors as names: slot ``p`` of a request's block holds the name of its tokens
    ``[0, p]``. A plan runs as the model runner runs it: the swap_out pairs copied (all read,
    then all written), then the swap_in pairs, then each scheduled request reads its earlier
    positions (checked) and writes the ones it computes."""

    def __init__(self) -> None:
        self.device: dict[int, list[int | None]] = defaultdict(lambda: [None] * BS)
        self.host: dict[int, list[int | None]] = {}
        self.reads = 0

    def run(self, plan: SchedulerOutput) -> None:
        assert len({h for _, h in plan.swap_out}) == len(plan.swap_out), "a host block written twice in one plan"
        assert len({d for _, d in plan.swap_in}) == len(plan.swap_in), "a device block written twice in one plan"
        for h, slots in [(h, list(self.device[d])) for d, h in plan.swap_out]:
            self.host[h] = slots
        for d, slots in [(d, list(self.host[h])) for h, d in plan.swap_in]:
            self.device[d] = slots
        for item in plan.scheduled:
            tokens, table, start = item.request.all_token_ids, item.block_ids, item.start_pos
            names = _names(tokens[: start + len(item.token_ids)])
            for p in range(start):
                got = self.device[table[p // BS]][p % BS]
                assert got == names[p], f"{item.request.request_id} reads a stale slot at position {p}"
            self.reads += start
            for p in range(start, len(names)):
                self.device[table[p // BS]][p % BS] = names[p]


def _names(tokens: list[int]) -> list[int]:
    out, name = [], 0
    for t in tokens:
        name = hash((name, t))
        out.append(name)
    return out


def _next_token(request: Request) -> int:
    """A fake model's greedy pick: a function of the whole token history, never EOS."""
    return 3 + _names(request.all_token_ids)[-1] % 40


def _chat(rng: random.Random, conversations: int, turns: int, user: int = 6, reply: int = 4):
    """Each conversation's turns: the user's new tokens (1 to ``user``) and the reply's
    length (1 to ``reply``)."""
    return [[([rng.randrange(3, 50) for _ in range(rng.randint(1, user))], rng.randint(1, reply))
             for _ in range(turns)] for _ in range(conversations)]


def _run_chat(kv: KVCacheManager, chats, concurrency: int, **config) -> tuple[list[list[int]], Scheduler, int]:
    """Multi-turn chats, each turn resending the history, ``concurrency`` turns at a time
    (the conversations take turns), on ``KVContents``; the replies, the scheduler and the
    prompt tokens computed."""
    sched = Scheduler(SchedulerConfig(**config), kv)
    memory, replies = KVContents(), [[] for _ in chats]
    history: list[list[int]] = [[] for _ in chats]
    turn = [0] * len(chats)

    def start(c: int) -> None:
        user, n = chats[c][turn[c]]
        history[c] += user
        sched.add_request(_request(f"c{c}t{turn[c]}", history[c], max_tokens=n, ignore_eos=True))

    queue = list(range(len(chats)))  # round robin: a conversation's next turn waits for the others'
    for _ in range(min(concurrency, len(chats))):
        start(queue.pop(0))
    for _ in range(20_000):
        if not sched.has_work():
            break
        plan = sched.schedule()
        memory.run(plan)
        sampled = {i.request.request_id: _next_token(i.request) for i in plan.scheduled if i.sample}
        ended = [r for r, _ in sched.update(plan, sampled)] + plan.finished
        for request in ended:
            if request.is_finished:
                c = int(request.request_id[1:].split("t")[0])
                history[c] = request.all_token_ids
                replies[c].append(request.output_token_ids)
                turn[c] += 1
                if turn[c] < len(chats[c]):
                    queue.append(c)
                if queue:
                    start(queue.pop(0))
    assert not sched.has_work(), "the chats did not finish"
    assert memory.reads > 0
    return [sum(r, []) for r in replies], sched, kv.stats.queries - kv.stats.hits


def _assert_all_returned(kv: KVCacheManager) -> None:
    tier = kv.host_tier
    assert kv.pool.num_used_blocks == 0, f"{kv.pool.num_used_blocks} device blocks still in use"
    assert kv.num_swap_blocks() == 0, "swap blocks still held"
    held = kv.cpu_pool.num_free_blocks + tier.num_entries + tier.num_held
    assert held == kv.cpu_pool.num_blocks, f"host blocks lost: {held} of {kv.cpu_pool.num_blocks} accounted for"
    kv.begin_step()
    assert tier.num_held == 0


def test_spills_run_before_the_forward_overwrites_and_restores_before_it_reads():
    # 8 conversations of 8 turns, histories of up to 144 tokens (36 blocks), 3 turns at a
    # time: about 4x the device's 40 blocks. Swap space is 8 blocks: swaps take the tier's.
    chats = _chat(random.Random(0), conversations=8, turns=8, reply=12)
    config = dict(max_num_batched_tokens=32, preemption_mode="swap")
    off, _, computed_off = _run_chat(_manager(num_blocks=41, num_cpu_blocks=8, host_cache_blocks=0), chats, 3,
                                     **config)
    kv = _manager(num_blocks=41, num_cpu_blocks=8 + 160, host_cache_blocks=160)
    on, sched, computed_on = _run_chat(kv, chats, 3, **config)
    assert on == off, "the replies must not depend on the tier"
    tier = kv.host_tier.stats
    assert tier.spills > 0 and tier.restores > 0, f"the chats outgrow 40 device blocks: {tier}"
    assert sched.stats.num_preemptions_swap > 0 and tier.dropped > 0, f"swaps should take tier blocks: {tier}"
    assert kv.stats.host_hits == tier.restores * BS
    assert computed_on < computed_off / 2, f"prompt tokens computed: {computed_on} with the tier, {computed_off} without"
    _assert_all_returned(kv)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(12, 30), swap=st.integers(0, 12),
       capacity=st.integers(1, 40), budget=st.sampled_from([8, 16, 64]),
       mode=st.sampled_from(["swap", "recompute", "auto"]), concurrency=st.integers(1, 4))
def test_any_pool_tier_and_schedule_reads_what_it_computed(seed, num_blocks, swap, capacity, budget, mode, concurrency):
    # Every request fits the smallest pool (44 tokens): 4 turns of at most 5 + 4 tokens.
    chats = _chat(random.Random(seed), conversations=5, turns=4, user=5, reply=4)
    config = dict(max_num_batched_tokens=budget, preemption_mode=mode, max_model_len=4096)
    off, _, _ = _run_chat(_manager(num_blocks, swap, 0), chats, concurrency, **config)
    kv = _manager(num_blocks, swap + capacity, capacity)
    on, _, _ = _run_chat(kv, chats, concurrency, **config)
    assert on == off
    _assert_all_returned(kv)


def test_a_restore_may_write_the_device_block_a_spill_of_the_same_plan_reads():
    kv = _manager(num_blocks=5)  # 4 blocks; each prompt takes 3 (2 hashed, 1 part-filled)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    memory, plans = KVContents(), []
    prefixes = [list(range(100 * k, 100 * k + 8)) for k in (1, 2, 3)]
    for turn in range(3):
        for k, prefix in enumerate(prefixes):
            sched.add_request(_request(f"p{k}t{turn}", prefix + [turn + 3], max_tokens=1, ignore_eos=True))
            plans.append(plan := sched.schedule())
            memory.run(plan)
            sched.update(plan, {i.request.request_id: 3 for i in plan.scheduled if i.sample})
    both = [p for p in plans if {d for d, _ in p.swap_out} & {d for _, d in p.swap_in}]
    assert both, "some plan should restore into a block whose old prefix it spills"
    assert kv.stats.host_hits == 4 * kv.host_tier.stats.restores > 0
    _assert_all_returned(kv)


# ------------------------------------------------------------------ the engine, with torch


def _rounds(vocab: int, seed: int, num_prefixes: int, prefix_len: int, rounds: int) -> list[list[list[int]]]:
    """``rounds`` rounds of one prompt per prefix: the prefix and a fresh tail."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [[p + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for p in prefixes] for _ in range(rounds)]


@pytest.fixture(scope="module")
def parity(tmp_path_factory, default_model):
    """A checkpoint whose outputs depend on attention, rounds of prompts over 8 prefixes of
    10 blocks (80 blocks against a 24-block pool) and transformers' greedy outputs for them."""
    from engine.model.model_config import ModelConfig
    from tests.helpers import build_hf_checkpoint
    from tests.unit.test_hf_parity import INIT, _hf_greedy, _hf_model

    model_dir = build_hf_checkpoint(tmp_path_factory.mktemp("host-tier"), "llama", default_model, **INIT)
    rounds = _rounds(ModelConfig.from_pretrained(model_dir).vocab_size, seed=5, num_prefixes=8, prefix_len=160,
                     rounds=3)
    lengths = [8, 24, 3, 16, 12, 1, 20, 6]
    model = _hf_model(model_dir)
    want = [_hf_greedy(model, prompts, lengths) for prompts in rounds]
    return str(model_dir), rounds, lengths, want


def _engine_rounds(model_dir: str, rounds, lengths, per_call: int, **engine_kwargs):
    """Each round's prompts through one ``LLM``, ``per_call`` at a time; outputs and the engine."""
    from engine import LLM

    llm = LLM(model=model_dir, **engine_kwargs)
    got = []
    for prompts in rounds:
        outs = []
        for i in range(0, len(prompts), per_call):
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths[i: i + per_call]]
            outs += [o.token_ids for o in llm.generate(prompts[i: i + per_call], params)]
        got.append(outs)
    return got, llm


def _assert_engine_returned_everything(llm) -> None:
    from tests.helpers import assert_engine_idle

    assert_engine_idle(llm)
    _assert_all_returned(llm.engine.kv_manager)


def test_greedy_outputs_match_hf_when_prefixes_come_back_from_the_host_tier(parity):
    model_dir, rounds, lengths, want = parity
    got, llm = _engine_rounds(model_dir, rounds, lengths, per_call=2, num_kv_blocks=25,
                              host_kv_cache_memory=1 << 22)
    assert got == want, "outputs with the host tier differ from transformers'"
    stats = llm.stats()
    assert stats.host_cache_blocks > 80, "the tier should hold every prefix"
    assert stats.host_cache_restores >= 8 * 9, f"each later round should restore its prefixes: {stats}"
    assert stats.host_cache_hit_rate > 0.5, f"host tier hit rate {stats.host_cache_hit_rate:.2f}"
    _assert_engine_returned_everything(llm)
    off, llm_off = _engine_rounds(model_dir, rounds, lengths, per_call=2, num_kv_blocks=25)
    assert off == want and llm_off.stats().host_cache_restores == 0
    assert stats.prefix_cache_hits > 2 * llm_off.stats().prefix_cache_hits


def test_swap_preemption_and_the_tier_share_the_host_pool_and_match_hf(parity):
    import torch

    from engine.model.kv_cache import bytes_per_block
    from engine.model.model_config import ModelConfig

    model_dir, rounds, lengths, want = parity
    per_block = bytes_per_block(ModelConfig.from_pretrained(model_dir), 16, torch.float32)
    # All 8 at once in 24 blocks: requests are swapped out while the tier (96 blocks)
    # holds prefixes; 8 blocks of swap space, so swaps take the tier's blocks.
    got, llm = _engine_rounds(model_dir, rounds, lengths, per_call=8, num_kv_blocks=25, preemption_mode="swap",
                              max_num_batched_tokens=64, swap_space=8 * per_block,
                              host_kv_cache_memory=96 * per_block)
    assert got == want, "outputs with swap and the host tier differ from transformers'"
    stats, tier = llm.stats(), llm.engine.kv_manager.host_tier.stats
    assert stats.host_cache_blocks == 96
    assert stats.num_preemptions_swap > 0 and stats.host_cache_restores > 0 and tier.dropped > 0, (
        f"swaps, restores and entries given way should all have happened: {stats}, {tier}")
    _assert_engine_returned_everything(llm)


def test_the_host_tier_setting_is_checked_and_sized_in_blocks(tiny_model):
    from engine import LLM, EngineConfig
    from engine.model.kv_cache import bytes_per_block

    with pytest.raises(ValueError, match="host_kv_cache_memory must be >= 0 bytes"):
        EngineConfig(host_kv_cache_memory=-1)
    assert EngineConfig().host_kv_cache_memory == 0, "off unless asked for"
    llm = LLM(model=tiny_model, num_kv_blocks=16, swap_space=0, host_kv_cache_memory=1 << 20)
    per_block = bytes_per_block(llm.engine.model_config, 16, llm.engine.kv_cache.dtype)
    assert llm.stats().host_cache_blocks == (1 << 20) // per_block == llm.engine.kv_cache.num_cpu_blocks


def test_the_benchmark_computes_fewer_prompt_tokens_with_the_tier_and_the_same_replies(tiny_model, tmp_path):
    """``bench.kv_tiers`` on a few short conversations of the tiny model."""
    import json

    import torch

    from bench.kv_tiers import main

    out = tmp_path / "kv_tiers.json"
    assert main(["--model", tiny_model, "--conversations", "6", "--turns", "4", "6", "--user-tokens", "8", "24",
                 "--reply-tokens", "4", "--threads", str(torch.get_num_threads()), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["replies_identical"], "the tier must not change a greedy reply"
    assert result["on"]["host_tier"]["restores"] > 0, result["on"]
    assert result["computed_on_over_off"] < 0.6, f"prompt tokens computed on/off: {result['computed_on_over_off']}"
    assert result["off"]["host_tier"]["blocks"] == 0 and result["off"]["host_tier"]["restores"] == 0


def test_tensor_parallel_ranks_spill_and_restore_the_same_blocks(parity):
    """At TP 2 every rank holds half the KV heads and runs the same plan: each copies the
    same spills and restores into its own host pool, and the outputs stay transformers'."""
    model_dir, rounds, lengths, want = parity
    got, llm = _engine_rounds(model_dir, rounds, lengths, per_call=8, num_kv_blocks=25, preemption_mode="swap",
                              max_num_batched_tokens=64, swap_space=1 << 16, host_kv_cache_memory=1 << 20,
                              tensor_parallel_size=2)
    with llm:
        assert got == want, "outputs at TP 2 with the host tier differ from transformers'"
        stats = llm.stats()
        assert stats.host_cache_restores > 0 and stats.num_preemptions_swap > 0, stats
        _assert_engine_returned_everything(llm)
