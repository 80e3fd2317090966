"""Blocks behind a sliding window given back (a model whose every layer slides): the
block manager's books (and a remote prompt's reservation, which leaves them out), greedy parity with transformers while requests are preempted
(recompute and swap) with blocks already given back, and what it saves on a long prompt."""

from __future__ import annotations

import pytest

from engine.core.block_pool import NULL_BLOCK_ID, KVCacheManager
from engine.core.request import Request
from engine.wire.sampling_params import SamplingParams

BS, WINDOW = 4, 8


def _running(kv: KVCacheManager, rid: str, num_tokens: int) -> Request:
    request = Request(rid, list(range(num_tokens)), SamplingParams())
    assert kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    kv.cache_blocks(request)
    return request


def test_blocks_wholly_behind_the_window_go_back_and_their_places_stay_null():
    kv = KVCacheManager(16, BS, window=WINDOW)
    request = _running(kv, "r", 21)  # positions 0..20: the next query is 21, keys from 14 on
    table = kv.block_ids("r")
    assert kv.release_outside_window(request) == 3, "blocks 0-2 (positions 0..11) are behind 21 - 8"
    assert kv.block_ids("r") == [NULL_BLOCK_ID] * 3 + table[3:]
    assert kv.pool.num_used_blocks == 3 and kv.num_released == 3
    assert kv.release_outside_window(request) == 0, "nothing more until the request moves on"
    request.output_token_ids.append(7)
    assert kv.allocate_slots(request, 1) is not None
    request.num_computed_tokens = 22
    assert kv.release_outside_window(request) == 0, "22 - 8 = 14: block 3 still holds position 14... 15"
    assert kv.pool.num_cached_blocks == 5, "given back, the full blocks stay in the prefix cache"
    kv.free(request)
    assert kv.pool.num_used_blocks == 0 and not kv.has_table("r")


def test_a_request_swapped_out_and_in_keeps_its_given_back_places():
    kv = KVCacheManager(16, BS, num_cpu_blocks=8, window=WINDOW)
    request = _running(kv, "r", 21)
    kv.release_outside_window(request)
    kept = kv.block_ids("r")[3:]
    out = kv.swap_out(request)
    assert [device for device, _ in out] == kept, "only the blocks still held go to swap space"
    assert kv.pool.num_used_blocks == 0 and kv.num_swapped_blocks("r") == 3
    back = kv.swap_in(request, 1)
    table = kv.block_ids("r")
    assert table[:3] == [NULL_BLOCK_ID] * 3 and len(table) == 6 and NULL_BLOCK_ID not in table[3:]
    assert [device for _, device in back] == table[3:6][: len(back)]
    kv.cache_blocks(request)  # its hashes start over after a swap: the null places are skipped
    assert kv.pool.blocks[NULL_BLOCK_ID].block_hash is None
    kv.free(request)
    assert kv.pool.num_used_blocks == 0 and kv.cpu_pool.num_free_blocks == 8


def test_a_remote_prompt_reserves_no_block_behind_the_window():
    """Decode role: the prompt's KV comes from another worker; blocks wholly behind the
    window at the prompt's end are neither reserved nor sent (NULL in the table)."""
    kv = KVCacheManager(16, BS, window=WINDOW)
    request = Request("r", list(range(21)), SamplingParams())  # keys from 13 on are read next (21 - 8)
    assert kv.reserve_remote(request, []) == 3, "blocks 0-2 (positions 0..11) are not sent"
    table = kv.block_ids("r")
    assert table[:3] == [NULL_BLOCK_ID] * 3 and len(table) == 6 and NULL_BLOCK_ID not in table[3:]
    assert kv.pool.num_used_blocks == 3
    request.num_computed_tokens = 21  # landed
    kv.cache_blocks(request)
    assert kv.pool.blocks[NULL_BLOCK_ID].block_hash is None, "a place behind the window is never cached"
    assert kv.release_outside_window(request) == 0, "nothing more to give back yet"
    kv.free(request)
    assert kv.pool.num_used_blocks == 0


def test_a_remote_prompt_reuses_only_cached_blocks_inside_the_window():
    kv = KVCacheManager(16, BS, window=WINDOW)
    kv.free(_running(kv, "first", 21))  # blocks of positions 0..19 cached
    request = Request("r", list(range(21)) + [99] * 4, SamplingParams())  # 25 tokens: keys from 17 on
    hit, _ = kv.get_computed_blocks(request)
    assert len(hit) == 5
    assert kv.reserve_remote(request, hit) == 5, "4 behind the window, the fifth cached: only the last is sent"
    table = kv.block_ids("r")
    assert table[:4] == [NULL_BLOCK_ID] * 4 and table[4] == hit[4].block_id and len(table) == 7
    assert [b.ref_cnt for b in hit] == [0, 0, 0, 0, 1], "cached blocks behind the window are not taken"
    kv.free(request)
    assert kv.pool.num_used_blocks == 0


def test_a_remote_prompt_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(4, BS, window=WINDOW)  # 3 usable blocks
    request = Request("r", list(range(40)), SamplingParams())  # 10 blocks, 8 behind the window
    assert kv.reserve_remote(request, []) == 8 and kv.pool.num_used_blocks == 2
    assert kv.reserve_remote(Request("s", list(range(20)), SamplingParams()), []) is None, "3 needed, 1 free"
    assert not kv.has_table("s") and kv.pool.num_used_blocks == 2
    kv.free(request)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, default_model):
    """A Mistral checkpoint whose every layer attends to the 48 latest keys."""
    from tests.helpers import build_hf_checkpoint

    return str(build_hf_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", default_model))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_hf_when_requests_growing_into_their_window_are_preempted(windowed, mode):
    from engine import LLM
    from tests.unit.test_hf_parity import _assert_same, _hf_greedy, _hf_model

    prompts = [[(7 * i + j) % 500 + 3 for j in range(6 + 3 * i)] for i in range(8)]
    lengths = [90] * len(prompts)
    want = _hf_greedy(_hf_model(windowed), prompts, lengths)
    llm = LLM(model=windowed, num_kv_blocks=14, preemption_mode=mode, enable_prefix_caching=False)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    _assert_same([o.token_ids for o in outs], want)
    stats = llm.stats()
    assert stats.num_window_released_blocks > 0
    done = {"recompute": stats.num_preemptions_recompute, "swap": stats.num_preemptions_swap}[mode]
    assert done > 0, f"8 requests growing toward 4 blocks each should not fit 13 blocks without {mode} preemptions"
    assert stats.num_blocks_in_use == 0


def test_a_long_prompt_holds_only_its_window_of_blocks(windowed):
    """A 440-token prompt (the checkpoint's context is 512) in 64-token chunks, 32 tokens
    out: without the window, 30 blocks of 16 at the end; with it, the window and one
    chunk's worth at any step."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(model=windowed, num_kv_blocks=256, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine.add_request(list(range(3, 443)), SamplingParams(max_tokens=32, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv_manager.pool.num_used_blocks)
    whole = -(-(440 + 32) // 16)
    bound = -(-(48 + 64) // 16) + 1  # the window and a chunk, plus a block they straddle
    print(f"\nwindow 48, 440-token prompt: at most {peak} blocks held, against {whole} without the window")
    assert peak <= bound < whole
    assert engine.stats().num_window_released_blocks >= whole - bound


def test_the_window_benchmark_counts_each_sides_blocks(tmp_path):
    """``bench.window`` on a short prompt: 256 tokens, a 64-token window, 64-token chunks."""
    from bench.window import build_checkpoint, measure

    prompt = [(7 * i) % 4000 + 3 for i in range(256)]
    whole = measure(build_checkpoint(tmp_path / "whole", 0, 512), prompt, 64, 4, 80)
    window = measure(build_checkpoint(tmp_path / "window", 64, 512), prompt, 64, 4, 80)
    assert whole == {"peak": 17, "after_prompt": 16, "reserved": 16, "sent": 16}
    assert window == {"peak": 5, "after_prompt": 4, "reserved": 4, "sent": 4}, "(256 - 64) / 16 = 12 blocks behind"
