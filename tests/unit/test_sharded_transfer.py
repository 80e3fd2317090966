"""KV between workers of different tensor-parallel sizes (``kv_transfer.sharded``): which heads
each rank reads, and real nixl reads between ranks' caches in one process (every rank an
agent of its own), TP 4 -> 2, 2 -> 1, 1 -> 2, 2 -> 4, 2 -> 2 and one KV head replicated.

Each decode rank must end with exactly its heads of the sender's blocks, receive exactly its
share's bytes (its own transfer stats), and the checksums summed rank by rank on each side
must agree; a header that does not fit is refused before a byte moves.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from bench.tp_transfer import InProcessWorker
from engine.model.parallel import kv_head_range
from engine.wire.messages import KVLayout
from kv_transfer.base import TransferError, TransferMeta
from kv_transfer.checksum import block_checksums
from kv_transfer.nixl import unavailable_reason
from kv_transfer.sharded import RankShare, ShardedPayload, read_plan

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 2, 12, 4, 8
SIZES = [1, 2, 4]


@pytest.mark.parametrize("heads", [8, 4, 2, 1])
@pytest.mark.parametrize("a", SIZES)
@pytest.mark.parametrize("b", SIZES)
def test_each_reader_rank_reads_its_heads_once_and_no_more_than_an_equal_size_transfer(heads, a, b):
    held = [kv_head_range(heads, a, r) for r in range(a)]
    total = 0
    for rank in range(b):
        lo, hi = kv_head_range(heads, b, rank)
        got = []
        for r in read_plan(heads, held, b, rank):
            start = held[r.share][0]
            assert r.src[1] - r.src[0] == r.dst[1] - r.dst[0]
            got += [start + h for h in range(*r.src)]
            assert [lo + h for h in range(*r.dst)] == [start + h for h in range(*r.src)], "each head lands in place"
        assert sorted(got) == list(range(lo, hi)), f"rank {rank} of {b} must read heads {lo}..{hi - 1} once"
        total += len(got)
    equal = sum(hi - lo for lo, hi in (kv_head_range(heads, b, r) for r in range(b)))
    assert total == equal, "a transfer between sizes moves what one between equal sizes at the reader's size does"


def test_replicated_heads_are_read_from_different_sender_ranks():
    """Four ranks hold one KV head twice each: the readers spread over the copies."""
    held = [kv_head_range(2, 4, r) for r in range(4)]
    assert held == [(0, 1), (0, 1), (1, 2), (1, 2)]
    shares = {r: [x.share for x in read_plan(2, held, 4, r)] for r in range(4)}
    assert shares == {0: [0], 1: [1], 2: [2], 3: [3]}


@pytest.mark.parametrize("shares", [[(0, 2)], [(0, 2), (1, 3)], [(0, 3), (2, 4)]])
def test_a_sharding_that_leaves_a_head_out_or_holds_one_twice_is_refused(shares):
    with pytest.raises(TransferError, match="not heads 0..3 once each") as e:
        read_plan(4, shares, 1, 0)
    assert e.value.reason == "layout"


NIXL_MISSING = unavailable_reason()
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl unavailable: {NIXL_MISSING}")


def _worker(size: int, heads: int, full=None) -> InProcessWorker:
    return InProcessWorker(size, (LAYERS, BLOCKS, BLOCK_SIZE, heads, HEAD_DIM), full)


def _meta(heads: int, n: int) -> TransferMeta:
    layout = KVLayout(num_layers=LAYERS, block_size=BLOCK_SIZE, num_kv_heads=heads, head_dim=HEAD_DIM, dtype="float32")
    return TransferMeta("t", "r", layout, num_blocks=n, num_tokens=n * BLOCK_SIZE, deadline=time.time() + 30)


def _full(heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(heads)
    return tuple(torch.randn(LAYERS, BLOCKS, BLOCK_SIZE, heads, HEAD_DIM, generator=g) for _ in range(2))


SRC, DST = [3, 4, 5, 9, 1], [7, 8, 0, 2, 11]  # a stretch, then scattered


@needs_nixl
@pytest.mark.parametrize(("a", "b", "heads"), [(4, 2, 4), (2, 1, 4), (1, 2, 4), (2, 4, 4), (2, 2, 4), (2, 4, 1),
                                               (1, 1, 4)])
def test_each_decode_rank_gets_exactly_its_heads_of_the_senders_blocks(a, b, heads):
    full = _full(heads)
    prefill, decode = _worker(a, heads, full), _worker(b, heads)
    try:
        meta = _meta(heads, len(SRC))
        sums = asyncio.run(prefill.ranks.checksums(SRC))
        assert sums == block_checksums(*full, SRC), "the ranks' sums add up to the whole blocks' sums"
        payload = prefill.ranks.offer(prefill.backends[0], meta, SRC)
        assert isinstance(payload, ShardedPayload) == (a > 1), "the header names the sender's sharding"
        asyncio.run(decode.ranks.read(decode.backends[0], meta, payload, DST))
        for rank, (k, v) in enumerate(decode.caches):
            lo, hi = kv_head_range(heads, b, rank)
            for got, want in ((k, full[0]), (v, full[1])):
                assert torch.equal(got[:, DST], want[:, SRC, :, lo:hi]), f"rank {rank} of {b}: heads {lo}..{hi - 1}"
            untouched = [i for i in range(BLOCKS) if i not in DST]
            assert not k[:, untouched].any() and not v[:, untouched].any(), "no other block is written"
            share = 2 * LAYERS * len(DST) * BLOCK_SIZE * (hi - lo) * HEAD_DIM * 4
            stats = decode.backends[rank].stats
            assert stats.bytes_received == share, f"rank {rank} receives its share's bytes, no more"
        assert asyncio.run(decode.ranks.checksums(DST)) == sums, "the reader's sums, rank by rank, match"
        assert all(b.staging_in_use == 0 for b in decode.backends), "every staging buffer is back"
    finally:
        prefill.close()
        decode.close()


@pytest.fixture
def tp2_pair():
    """A prefill and a decode worker at TP 2 (4 KV heads), and an offer of two blocks."""
    prefill, decode = _worker(2, 4, _full(4)), _worker(2, 4)
    meta = _meta(4, 2)
    yield prefill, decode, meta, prefill.ranks.offer(prefill.backends[0], meta, SRC[:2])
    prefill.close()
    decode.close()


@needs_nixl
def test_a_header_that_does_not_fit_is_refused_before_a_byte_moves(tp2_pair):
    _, decode, meta, payload = tp2_pair
    bad = [
        ShardedPayload(2, payload.shares),  # another model's head count
        ShardedPayload(4, (payload.shares[0], RankShare((0, 2), payload.shares[1].payload))),  # heads 2-3 missing
        ShardedPayload(4, (payload.shares[0], RankShare((2, 3), payload.shares[1].payload))),  # 1 claimed, 2 held
    ]
    for offer in bad:
        with pytest.raises(TransferError) as e:
            asyncio.run(decode.ranks.read(decode.backends[0], meta, offer, DST[:2]))
        assert e.value.reason == "layout", e.value
    assert all(b.stats.received == 0 for b in decode.backends), "nothing was read"


@needs_nixl
def test_one_ranks_failed_read_fails_the_transfer_once_every_read_has_ended(tp2_pair):
    prefill, decode, meta, payload = tp2_pair
    decode.peers[0].fail = TransferError("peer_lost", "injected: rank 1's sender is gone")
    with pytest.raises(TransferError, match="injected") as e:
        asyncio.run(decode.ranks.read(decode.backends[0], meta, payload, DST[:2]))
    assert e.value.reason == "peer_lost"
    assert decode.backends[0].stats.received == 1, "rank 0's own read ran to its end first"
    decode.peers[0].fail = None
    k, v = prefill.caches[1]
    k[:, SRC[0]] += 1  # rank 1's share changes after it was summed: the reader's sums differ
    asyncio.run(decode.ranks.read(decode.backends[0], meta, payload, DST[:2]))
    assert asyncio.run(decode.ranks.checksums(DST[:2])) != block_checksums(*_full(4), SRC[:2])
