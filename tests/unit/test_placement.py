"""Placement policies, from plain load records: no Ray, no clock."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from engine.core.block_hash import BlockHasher
from router.placement import PrefixIndex, pick_affine, pick_decode, pick_prefill, round_robin


@dataclass
class P:
    queued_prefill_tokens: int


@dataclass
class D:
    free_blocks: int
    running: int = 0
    waiting: int = 0
    waiting_for_kv: int = 0
    total_blocks: int = 100


def test_prefill_goes_to_the_worker_with_the_fewest_queued_tokens():
    assert pick_prefill([P(300), P(100), P(200)]) == 1


def test_prefill_counts_tokens_placed_since_the_last_report():
    assert pick_prefill([P(100), P(150)], pending=[100, 0]) == 1


def test_prefill_ties_rotate_between_workers():
    picks = Counter(pick_prefill([P(0), P(0), P(0)], tie_break=t) for t in range(9))
    assert picks == {0: 3, 1: 3, 2: 3}


def test_prefill_prefers_the_worker_that_cached_the_prefix_when_it_is_not_much_busier():
    loads = [P(0), P(1000)]
    assert pick_prefill(loads, cached_tokens=[0, 512], max_imbalance_tokens=4096) == 1


def test_prefill_leaves_an_affine_worker_that_is_much_busier():
    loads = [P(0), P(10_000)]
    assert pick_prefill(loads, cached_tokens=[0, 512], max_imbalance_tokens=4096) == 0


def test_prefill_picks_the_longest_cached_prefix():
    assert pick_prefill([P(0), P(0), P(0)], cached_tokens=[16, 64, 32]) == 1


def test_no_prefill_workers_means_no_choice():
    assert pick_prefill([]) is None


def test_decode_goes_to_the_worker_with_the_most_free_blocks_where_kv_binds():
    assert pick_decode([D(10), D(50), D(30)], blocks_needed=5, max_running=8) == 1


def test_decode_goes_to_the_worker_with_the_fewest_requests_where_seats_bind():
    """KV to spare everywhere (a GPU's pool holds far more than a batch of chat turns):
    blocks would send every arrival to the worker a few blocks emptier; seats spread them."""
    roomy = [D(900, running=10, total_blocks=1000), D(500, running=2, total_blocks=1000)]
    assert pick_decode(roomy, blocks_needed=5, max_running=16) == 1  # 10/16 of its seats against 50% of its KV
    assert pick_decode(roomy, blocks_needed=5, max_running=256) == 0  # 4% of the seats: now KV binds


def test_decode_skips_workers_at_the_running_cap_and_without_room():
    loads = [D(100, running=8), D(4), D(20, waiting_for_kv=2)]
    assert pick_decode(loads, blocks_needed=5, max_running=8) == 2
    assert pick_decode(loads[:2], blocks_needed=5, max_running=8) is None


def test_decode_counts_the_blocks_its_waiting_requests_will_take():
    # Worker 0 reports more free blocks, but 5 requests queued there hold none yet.
    assert pick_decode([D(100, waiting=5), D(90)], blocks_needed=4, max_running=64) == 1
    assert pick_decode([D(100, waiting=2), D(90)], blocks_needed=4, max_running=64) == 0


def test_decode_subtracts_blocks_promised_but_not_yet_reported():
    assert pick_decode([D(50), D(40)], blocks_needed=5, max_running=8, pending_blocks=[20, 0]) == 1


def test_round_robin_cycles_through_every_worker():
    assert [round_robin(3, c) for c in range(6)] == [0, 1, 2, 0, 1, 2]
    assert round_robin(0, 5) is None


def test_round_robin_skips_workers_without_room():
    room = [True, False, True]
    assert [round_robin(3, c, room) for c in range(4)] == [0, 2, 2, 0]
    assert round_robin(3, 1, [False, False, False]) is None


def prefix_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    return BlockHasher(seed="placement").hash_blocks(tokens, block_size)


def test_prefix_index_matches_leading_blocks_and_forgets_the_oldest():
    index = PrefixIndex(capacity_blocks=3)
    shared = prefix_hashes(list(range(48)), 16)
    index.record("w0", shared)
    assert index.matched_blocks("w0", shared) == 3
    assert index.matched_blocks("w1", shared) == 0
    assert index.matched_blocks("w0", prefix_hashes([7] * 48, 16)) == 0
    index.record("w0", prefix_hashes([7] * 16, 16))  # evicts the oldest shared block
    assert index.matched_blocks("w0", shared) == 0
    index.forget("w0")
    assert index.matched_blocks("w0", prefix_hashes([7] * 16, 16)) == 0


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=8), st.integers(0, 100))
def test_prefill_without_cache_always_picks_a_least_queued_worker(queued, tie):
    i = pick_prefill([P(q) for q in queued], tie_break=tie)
    assert queued[i] == min(queued)


@given(
    st.lists(st.tuples(st.integers(0, 100), st.integers(0, 10)), min_size=1, max_size=8),
    st.integers(1, 20),
    st.integers(1, 10),
)
def test_decode_choice_always_has_room_and_no_worker_with_room_is_emptier_in_both(workers, need, cap):
    loads = [D(free, running=run) for free, run in workers]  # nothing waiting
    i = pick_decode(loads, need, cap)
    eligible = [w for w in loads if w.free_blocks >= need and w.running < cap]
    if not eligible:
        assert i is None
        return
    chosen = loads[i]
    assert chosen.free_blocks >= need and chosen.running < cap
    for w in eligible:  # more free blocks and fewer requests at once: it would have been the choice
        assert not (w.free_blocks >= chosen.free_blocks and w.running <= chosen.running
                    and (w.free_blocks, w.running) != (chosen.free_blocks, chosen.running)), (w, chosen)


def test_pick_affine_follows_the_named_worker_only_while_it_is_listed_and_has_room():
    keys = ["decode-0", "decode-1", "decode-2"]
    assert pick_affine(keys, "decode-1") == 1
    assert pick_affine(keys, "decode-1", room=[True, False, True]) is None, "a full worker is passed over"
    assert pick_affine(keys, "decode-9") is None and pick_affine(keys, None) is None


def test_decode_prefers_the_worker_caching_the_prefix_while_it_is_not_much_busier():
    loads = [D(90), D(50, running=4), D(80)]
    assert pick_decode(loads, 5, 32, cached_blocks=[0, 3, 1]) == 1, "the longest cached prefix wins"
    busy = [D(90), D(50, running=9), D(80)]
    assert pick_decode(busy, 5, 32, cached_blocks=[0, 3, 0], max_imbalance_requests=8) == 0, "too busy: most free"
    full = [D(90), D(4), D(80)]
    assert pick_decode(full, 5, 32, cached_blocks=[0, 3, 2]) == 2, "no room: the next longest prefix"
    assert pick_decode(loads, 5, 32, cached_blocks=[0, 0, 0]) == 0, "no prefix anywhere: most free"


@given(
    st.lists(st.tuples(st.integers(0, 100), st.integers(0, 20), st.integers(0, 4)), min_size=1, max_size=8),
    st.integers(1, 20),
    st.integers(0, 12),
)
def test_an_affine_decode_choice_has_room_and_is_never_much_busier(workers, need, imbalance):
    loads = [D(free, running=run) for free, run, _ in workers]
    cached = [c for _, _, c in workers]
    i = pick_decode(loads, need, 21, cached_blocks=cached, max_imbalance_requests=imbalance)
    room = [w for w in loads if w.free_blocks >= need and w.running < 21]
    if not room:
        assert i is None
        return
    assert loads[i].free_blocks >= need and loads[i].running < 21
    if i != pick_decode(loads, need, 21):  # an affine choice
        assert cached[i] > 0 and loads[i].running - min(w.running for w in room) <= imbalance


def test_prefill_here_rules():
    from engine.wire.messages import DecodeLoad
    from router.placement import prefill_here

    idle, busy = DecodeLoad("d", 10, 10, 0, 0, 0), DecodeLoad("d", 10, 10, 2, 1, 0)
    assert prefill_here(16, [0], idle, 16, 0) == "short" and prefill_here(17, [0], idle, 16, 0) is None
    assert prefill_here(10, [0], idle, 0, 0) is None, "0 turns the short rule off"
    assert prefill_here(900, [5000, 4000], idle, 16, 4000) == "prefill_busy"
    assert prefill_here(900, [5000, 3999], idle, 16, 4000) is None, "one prefill worker under the backlog"
    assert prefill_here(900, [5000], busy, 16, 4000) is None, "the decode worker has requests waiting"
    assert prefill_here(900, [], idle, 16, 4000) is None, "no prefill load known"


def test_decode_ties_rotate_between_workers():
    picks = Counter(pick_decode([D(40), D(40), D(40)], 5, 8, tie_break=t) for t in range(9))
    assert picks == {0: 3, 1: 3, 2: 3}
