"""The paged KV block pool: ref counts, eviction order, prefix hashing and swap space.

Pure Python, no torch: ``BlockPool``, ``CpuBlockPool`` and ``KVCacheManager`` are
driven directly with hand-made requests. A stateful property test then runs random
sequences of allocate / append / free / swap / prefix lookup over several requests
and checks the pool's books after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_hash import BlockHasher
from engine.core.block_pool import NULL_BLOCK_ID, BlockPool, CpuBlockPool, KVCacheManager
from engine.core.request import Request
from engine.wire.sampling_params import SamplingParams

BS = 4  # block size used throughout


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def _compute(kv: KVCacheManager, request: Request, hit=()) -> list[int]:
    """Allocate a new request's missing blocks, mark its tokens computed, cache its full blocks."""
    num_hit = len(hit) * kv.block_size
    new = kv.allocate_slots(request, request.num_tokens - num_hit, hit)
    assert new is not None, f"allocation for {request.request_id} should succeed"
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return kv.block_ids(request.request_id)


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ------------------------------------------------------------------ BlockPool


def test_null_block_is_never_handed_out():
    pool = BlockPool(8)
    blocks = pool.allocate(pool.num_usable_blocks)
    assert sorted(_ids(blocks)) == list(range(1, 8)), (
        f"the 7 usable blocks should be ids 1..7 (0 is the null block), got {_ids(blocks)}"
    )
    assert pool.allocate(1) is None, "with every usable block taken, even 1 more should fail"
    pool.free(blocks)
    again = pool.allocate(7)
    assert NULL_BLOCK_ID not in _ids(again), "block 0 must not come back out after a free"


def test_pool_needs_a_usable_block_besides_the_null_block():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockPool(1)


def test_allocate_returns_none_and_changes_nothing_when_short():
    pool, twin = BlockPool(6), BlockPool(6)
    for p in (pool, twin):
        held = p.allocate(3)
        p.free([held[2], held[0]])  # some churn so the free queue order is not trivial
    assert pool.allocate(pool.num_free_blocks + 1) is None, "asking for more than is free gives None"
    assert pool.num_free_blocks == twin.num_free_blocks, "a failed allocate must not take blocks"
    assert _ids(pool.allocate(pool.num_free_blocks)) == _ids(twin.allocate(twin.num_free_blocks)), (
        "a failed allocate must not reorder the free queue"
    )


def test_ref_counts_follow_allocate_touch_and_free():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    assert block.ref_cnt == 1, "a freshly allocated block has one reference"
    pool.touch([block])
    assert block.ref_cnt == 2, "touch adds a reference"
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2, (
        "a block with a reference left must stay out of the free queue"
    )
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 3, "the last free returns it to the queue"
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])


def test_freed_first_is_evicted_first():
    pool = BlockPool(6)
    a = pool.allocate(5)
    pool.free([a[3], a[1], a[4]])
    got = _ids(pool.allocate(3))
    assert got == [a[3].block_id, a[1].block_id, a[4].block_id], (
        f"blocks should be reused in the order they were freed, got {got}"
    )


def test_a_requests_tail_blocks_are_evicted_before_its_head_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # exactly 3 usable blocks
    prompt = list(range(1, 13))  # 3 full blocks
    ids = _compute(kv, _request("a", prompt))
    kv.free(_request("a", prompt))
    got = _ids(kv.pool.allocate(1))
    assert got == [ids[-1]], f"the tail block {ids[-1]} should be evicted first, got {got}"
    hit, num_hit = kv.get_computed_blocks(_request("b", prompt + [99]))
    assert _ids(hit) == ids[:2] and num_hit == 2 * BS, (
        f"the head blocks {ids[:2]} should still be cached, got a hit on {_ids(hit)}"
    )


# ------------------------------------------------------------------ prefix cache


def test_prefix_hit_on_a_free_cached_block_pulls_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 9))  # 2 full blocks
    first = _request("a", prompt)
    cached = _compute(kv, first)
    kv.free(first)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks, "freed cached blocks count as free"
    assert kv.pool.usage == 0.0, f"a free block holding a cached prefix is not in use (usage {kv.pool.usage})"

    second = _request("b", prompt + [42])
    hit, num_hit = kv.get_computed_blocks(second)
    assert _ids(hit) == cached and num_hit == 8, f"expected a 2-block hit on {cached}, got {_ids(hit)}"
    new = kv.allocate_slots(second, 1, hit)
    assert new is not None and len(new) == 1, "one new block for the 9th token"
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks - 3, (
        "the 2 reused blocks and the new one should all leave the free queue"
    )
    assert all(b.ref_cnt == 1 for b in hit), "reused blocks get one reference"
    rest = _ids(kv.pool.allocate(kv.pool.num_free_blocks))
    assert not set(rest) & set(cached), "blocks in use by a prefix hit must not be handed out again"
    assert all(kv.pool.lookup(b.block_hash) is b for b in hit), "reused blocks keep their hashes"


def test_allocate_slots_counts_reused_free_blocks_against_what_is_free():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    prompt = list(range(1, 9))
    first = _request("a", prompt)
    _compute(kv, first)
    kv.free(first)
    other = _request("x", [7])
    assert kv.allocate_slots(other, 1) is not None  # takes the one uncached free block

    big = _request("b", prompt + list(range(20, 25)))  # 13 tokens: 2 hit blocks + 2 new
    hit, _ = kv.get_computed_blocks(big)
    assert len(hit) == 2
    assert kv.allocate_slots(big, 5, hit) is None, (
        "2 free blocks cannot hold 2 reused cached blocks and 2 new ones"
    )
    assert kv.pool.num_free_blocks == 2, "a failed allocate_slots must not take blocks"
    assert all(b.ref_cnt == 0 for b in hit), "a failed allocate_slots must not touch the hit blocks"
    assert kv.block_ids("b") == [], "a failed allocate_slots must leave the request without blocks"


def test_eviction_drops_the_hash():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(1, 13))
    first = _request("a", prompt)
    _compute(kv, first)
    blocks = [kv.pool.blocks[i] for i in kv.block_ids("a")]
    hashes = [b.block_hash for b in blocks]
    assert None not in hashes, "full computed blocks should be registered"
    kv.free(first)
    kv.pool.allocate(3)  # evicts all three
    assert all(b.block_hash is None for b in blocks), "an evicted block must lose its hash"
    assert all(kv.pool.lookup(h) is None for h in hashes), "an evicted hash must leave the index"
    hit, num_hit = kv.get_computed_blocks(_request("b", prompt + [1]))
    assert num_hit == 0, f"nothing should hit after eviction, got {num_hit} tokens"


def test_block_hashes_are_chained_over_the_prefix():
    same_tail = [5, 6, 7, 8]
    hasher = BlockHasher(seed="s")
    a = hasher.hash_blocks([1, 2, 3, 4] + same_tail, BS)
    b = hasher.hash_blocks([9, 9, 9, 9] + same_tail, BS)
    assert a[1] != b[1], "equal block tokens after different prefixes must hash differently"
    assert a == hasher.hash_blocks([1, 2, 3, 4] + same_tail + [1, 2], BS), (
        "equal prefixes hash equally, and a partial trailing block is not hashed"
    )

    kv = KVCacheManager(num_blocks=8, block_size=BS, hasher=hasher)
    _compute(kv, _request("a", [1, 2, 3, 4] + same_tail))
    hit, num_hit = kv.get_computed_blocks(_request("b", [9, 9, 9, 9] + same_tail + [1]))
    assert num_hit == 0, "a request with a different first block must not hit the second block"


@pytest.mark.parametrize(
    "prompt_len, want_blocks",
    [(8, 1), (9, 2), (7, 1), (4, 0), (12, 2)],
)
def test_prefix_hit_leaves_at_least_one_token_to_compute(prompt_len, want_blocks):
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    _compute(kv, _request("a", list(range(1, 13))))  # 3 cached blocks
    hit, num_hit = kv.get_computed_blocks(_request("b", list(range(1, prompt_len + 1))))
    assert len(hit) == want_blocks and num_hit == want_blocks * BS, (
        f"a {prompt_len}-token prompt over cached blocks should hit {want_blocks} blocks "
        f"(capped at num_tokens - 1), got {len(hit)}"
    )


def test_caching_disabled_gives_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    prompt = list(range(1, 9))
    first = _request("a", prompt)
    ids = _compute(kv, first)
    assert all(kv.pool.blocks[i].block_hash is None for i in ids), "no block may be hashed"
    kv.free(first)
    hit, num_hit = kv.get_computed_blocks(_request("b", prompt + [1]))
    assert hit == [] and num_hit == 0, f"caching is off: expected no hit, got {num_hit} tokens"


def test_prefix_hit_shares_blocks_between_live_requests():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 9))
    a = _request("a", prompt + [50])
    a_ids = _compute(kv, a)
    b = _request("b", prompt + [60])
    hit, _ = kv.get_computed_blocks(b)
    b_ids = _compute(kv, b, hit)
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2], "the shared prefix blocks are shared"
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids[:2]] == [2, 2], "shared blocks have 2 refs"
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in b_ids] == [1, 1, 1], (
        "freeing one sharer leaves the other's references"
    )
    assert kv.pool.num_used_blocks == 3


# ------------------------------------------------------------------ swap space


def test_swap_out_then_in_round_trips_the_block_pairs():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_cpu_blocks=4)
    req = _request("a", list(range(1, 11)))  # 3 blocks
    device_before = _compute(kv, req)

    out = kv.swap_out(req)
    assert out is not None and [d for d, _ in out] == device_before, (
        f"swap_out should pair every device block in order, got {out}"
    )
    cpu = [c for _, c in out]
    assert len(set(cpu)) == 3 and all(0 <= c < 4 for c in cpu), f"3 distinct cpu blocks, got {cpu}"
    assert kv.block_ids("a") == [] and kv.pool.num_used_blocks == 0, "swap_out frees the device blocks"
    assert kv.cpu_pool.num_free_blocks == 1 and kv.num_swapped_blocks("a") == 3

    back = kv.swap_in(req)
    assert back is not None and [c for c, _ in back] == cpu, (
        f"swap_in should read the same cpu blocks in order, got {back}"
    )
    assert [d for _, d in back] == kv.block_ids("a"), "swap_in pairs name the new device blocks"
    assert kv.pool.num_used_blocks == 3 and kv.cpu_pool.num_free_blocks == 4, (
        "swap_in takes device blocks and returns the cpu ones"
    )
    assert kv.num_swapped_blocks("a") == 0


def test_swap_out_without_cpu_room_returns_none_and_keeps_the_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_cpu_blocks=2)
    req = _request("a", list(range(1, 11)))
    ids = _compute(kv, req)
    assert kv.swap_out(req) is None, "3 blocks cannot go to a 2-block swap space"
    assert kv.block_ids("a") == ids and kv.cpu_pool.num_free_blocks == 2, "nothing may change"


def test_swap_in_without_device_room_returns_none_and_keeps_the_swap():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    req = _request("a", list(range(1, 11)))
    _compute(kv, req)
    kv.swap_out(req)
    hog = _request("h", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(hog, 5) is not None  # 2 of 3 device blocks
    assert kv.swap_in(req) is None, "3 swapped blocks cannot come back into 1 free block"
    assert kv.num_swapped_blocks("a") == 3 and kv.pool.num_free_blocks == 1, "nothing may change"


def test_free_returns_swap_space_too():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_cpu_blocks=4)
    req = _request("a", list(range(1, 11)))
    _compute(kv, req)
    kv.swap_out(req)
    kv.free(req)
    assert kv.cpu_pool.num_free_blocks == 4 and kv.num_swapped_blocks("a") == 0


def test_cpu_pool_allocates_distinct_ids_and_refuses_when_short():
    cpu = CpuBlockPool(3)
    assert cpu.allocate(0) == [] and cpu.num_free_blocks == 3, "allocating 0 takes nothing"
    got = cpu.allocate(2)
    assert len(set(got)) == 2 and cpu.num_free_blocks == 1
    assert cpu.allocate(2) is None and cpu.num_free_blocks == 1
    cpu.free(got)
    assert sorted(cpu.allocate(3)) == [0, 1, 2]


# ------------------------------------------------------------------ property test

NUM_BLOCKS = 10
NUM_CPU_BLOCKS = 6
tokens = st.integers(1, 3)  # a small alphabet so prompts share prefixes often


class KVCacheMachine(RuleBasedStateMachine):
    """Random requests over one manager; a shadow model tracks what each block holds.

    ``content[block_id]`` is the token prefix whose KV a full block holds (the whole
    prefix, since a block's KV depends on everything before it). A prefix hit must
    only ever return blocks whose content is exactly the looked-up prefix.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv_manager = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.live: dict[str, Request] = {}
        self.swapped: dict[str, tuple[Request, list[int]]] = {}
        self.hit_blocks: dict[str, int] = {}  # leading blocks a request reused, not wrote
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    # -- helpers

    def _snapshot(self):
        return (
            self.kv_manager.pool.num_free_blocks,
            self.kv_manager.cpu_pool.num_free_blocks,
            {rid: self.kv_manager.block_ids(rid) for rid in self.live},
        )

    def _record(self, req: Request) -> None:
        ids = self.kv_manager.block_ids(req.request_id)
        tokens_ = req.all_token_ids
        for i in range(self.hit_blocks[req.request_id], req.num_computed_tokens // BS):
            self.content[ids[i]] = tuple(tokens_[: (i + 1) * BS])

    def _check_hit(self, req: Request, hit, num_hit: int) -> None:
        assert num_hit == len(hit) * BS and num_hit < req.num_tokens, (
            f"a hit of {num_hit} tokens on a {req.num_tokens}-token prompt must leave one to compute"
        )
        for i, block in enumerate(hit):
            want = tuple(req.prompt_token_ids[: (i + 1) * BS])
            assert self.content.get(block.block_id) == want, (
                f"prefix hit returned block {block.block_id} holding "
                f"{self.content.get(block.block_id)}, expected {want}"
            )

    def _swap(self, swap, req, *args):
        """``swap(req, *args)``'s block pairs; a swap that fails (None) must change nothing."""
        before = self._snapshot()
        pairs = swap(req, *args)
        if pairs is None:
            assert self._snapshot() == before, f"a failed {swap.__name__} must change nothing"
        return pairs

    # -- rules

    @rule(prompt=st.lists(tokens, min_size=1, max_size=14))
    def add_request(self, prompt):
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = _request(rid, prompt)
        hit, num_hit = self.kv_manager.get_computed_blocks(req)
        self._check_hit(req, hit, num_hit)
        before = self._snapshot()
        new = self.kv_manager.allocate_slots(req, len(prompt) - num_hit, hit)
        if new is None:
            assert self._snapshot() == before, "a failed allocation must change nothing"
            self.kv_manager.free(req)  # given up, as an abort would
            return
        for b in new:
            self.content.pop(b.block_id, None)
        self.live[rid] = req
        self.hit_blocks[rid] = len(hit)
        req.num_computed_tokens = len(prompt)
        self.kv_manager.cache_blocks(req)
        self._record(req)

    @rule(prompt=st.lists(tokens, min_size=1, max_size=14))
    def prefix_lookup(self, prompt):
        probe = _request("probe", prompt)
        hit, num_hit = self.kv_manager.get_computed_blocks(probe)
        self._check_hit(probe, hit, num_hit)
        self.kv_manager.free(probe)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=tokens)
    def append_token(self, data, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.output_token_ids.append(token)
        before = self._snapshot()
        new = self.kv_manager.allocate_slots(req, 1)
        if new is None:
            assert self._snapshot() == before, "a failed allocation must change nothing"
            req.output_token_ids.pop()
            return
        for b in new:
            self.content.pop(b.block_id, None)
        req.num_computed_tokens += 1
        self.kv_manager.cache_blocks(req)
        self._record(req)

    @precondition(lambda self: self.live or self.swapped)
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live) + sorted(self.swapped)))
        req = self.live.pop(rid, None) or self.swapped.pop(rid)[0]
        self.kv_manager.free(req)
        assert self.kv_manager.block_ids(rid) == [] and self.kv_manager.num_swapped_blocks(rid) == 0

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        device = self.kv_manager.block_ids(rid)
        pairs = self._swap(self.kv_manager.swap_out, req)
        if pairs is None:
            return
        assert [d for d, _ in pairs] == device, "swap_out must copy every device block in order"
        del self.live[rid]
        self.swapped[rid] = (req, [c for _, c in pairs])

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        req, cpu = self.swapped[rid]
        num_new_tokens = data.draw(st.integers(0, 2 * BS))
        pairs = self._swap(self.kv_manager.swap_in, req, num_new_tokens)
        if pairs is None:
            return
        assert [c for c, _ in pairs] == cpu, "swap_in must read the cpu blocks swap_out wrote"
        table = self.kv_manager.block_ids(rid)
        assert [d for _, d in pairs] == table[: len(cpu)], "the swapped blocks come back first, in order"
        need = self.kv_manager.num_blocks_needed(req.num_computed_tokens + num_new_tokens)
        assert len(table) >= need, f"swap_in must leave room for {num_new_tokens} more tokens"
        del self.swapped[rid]
        self.live[rid] = req
        for d in table:
            self.content.pop(d, None)
        self.hit_blocks[rid] = 0  # every block is now its own copy
        self.kv_manager.cache_blocks(req)
        self._record(req)

    # -- invariants

    @invariant()
    def block_books_balance(self):
        pool = self.kv_manager.pool
        refs = Counter(b for rid in self.live for b in self.kv_manager.block_ids(rid))
        assert NULL_BLOCK_ID not in refs, "the null block must never be in a block table"
        assert pool.blocks[NULL_BLOCK_ID].ref_cnt == 0
        for block in pool.blocks[1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id} has a negative ref count"
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id} has ref {block.ref_cnt} but is in {refs[block.block_id]} tables"
            )
        in_use = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert in_use <= pool.num_usable_blocks
        assert pool.num_free_blocks + in_use == pool.num_usable_blocks, (
            f"free ({pool.num_free_blocks}) + in use ({in_use}) != usable ({pool.num_usable_blocks})"
        )
        for rid, req in self.live.items():
            assert len(self.kv_manager.block_ids(rid)) * BS >= req.num_computed_tokens, (
                f"{rid} has too few blocks for its {req.num_computed_tokens} tokens"
            )
        for rid in self.swapped:
            assert self.kv_manager.block_ids(rid) == [], f"swapped {rid} must hold no device blocks"
        on_cpu = sum(self.kv_manager.num_swapped_blocks(rid) for rid in self.swapped)
        assert on_cpu + self.kv_manager.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS

    def teardown(self):
        for req in list(self.live.values()) + [r for r, _ in self.swapped.values()]:
            self.kv_manager.free(req)
        pool = self.kv_manager.pool
        assert pool.num_free_blocks == pool.num_usable_blocks, "every block is free at the end"
        assert all(b.ref_cnt == 0 for b in pool.blocks), "every ref count is 0 at the end"
        assert self.kv_manager.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_manager_random_operations_keep_the_books = KVCacheMachine.TestCase
