"""KV between workers of any tensor-parallel sizes: each rank reads exactly the heads it holds.

A worker at ``tensor_parallel_size`` N keeps each block's KV heads split over its N ranks
(``engine.model.parallel.kv_head_range``: 1/N of them a rank, or one head shared by N / heads
ranks when there are fewer heads than ranks). Every rank registers its own share of the paged
cache with its own nixl agent; the block ids are the same on every rank (rank 0's block pool
hands them out). So a prefill worker at size ``a`` offers its blocks as ``a`` shares, and each
rank of a decode worker at size ``b`` reads its heads from whichever shares hold them::

    prefill, a = 2 (4 KV heads)            decode, b = 1            decode, b = 4
    rank 0: heads 0-1 ─────────┬─────────▶ rank 0: heads 0-3   or   rank 0: head 0, rank 1: head 1
    rank 1: heads 2-3 ─────────┘           (two reads)              rank 2: head 2, rank 3: head 3

The offer (``ShardedPayload``) is the header: the model's KV heads and, per sender rank, the
heads it holds and its backend's payload. The reader checks it against its own layout before a
byte moves (every head covered once, each share's head count as its payload says). Rank 0 of
the decode worker reads its share and asks its other ranks to read theirs, all at once; the
attempt's read ends only when every rank's has (one failure fails it; one that cannot be
cancelled holds the blocks until it settles, as at one rank). Each rank sums the heads it holds
(``kv_transfer.checksum``: a block's sums over any split of its heads add up to one number),
so one checksum a block covers every rank's share on both sides, and ranks holding the same
head must agree.

Between equal sizes each rank pair moves whole blocks. Between different sizes
(``NixlBackend.pull_heads``): a reader that needs every head a sender rank holds (a prefill
worker wider than the decode worker) reads that rank's whole blocks into a registered
staging buffer and copies them into its heads; one that needs some of them (a decode worker
wider) reads a head's row of each token, the longest stretch alike on both sides of the
``[block, token, heads, dim]`` layout, so a descriptor a token (on GPUs, where staging sits
in host memory, both ways). No rank reads a head it does not hold, so a transfer between
different sizes moves no more bytes than one between equal sizes.

Only nixl reads a share of a block in place; the service refuses other backends for workers
above one rank when it has a prefill pool (``cluster.config``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from engine.model.parallel import kv_head_range
from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta
from kv_transfer.checksum import block_checksums

Heads = tuple[int, int]  # KV heads [start, stop)
_MASK = (1 << 32) - 1


@dataclass(frozen=True)
class RankShare:
    """One sender rank's part of an offer: the model's KV heads it holds and its backend's payload."""

    heads: Heads
    payload: Any


@dataclass(frozen=True)
class ShardedPayload:
    """A tensor-parallel sender's offer, one share a rank in rank order: the header that
    names its sharding (the model's KV heads, each rank's) and what each rank's reader needs."""

    num_kv_heads: int
    shares: tuple[RankShare, ...]


@dataclass(frozen=True)
class HeadRead:
    """One read of a reader rank: heads ``src`` of share ``share``'s cache (its own
    indices) into heads ``dst`` of the reader's."""

    share: int
    src: Heads
    dst: Heads


def read_plan(num_kv_heads: int, shares: Sequence[Heads], size: int, rank: int) -> list[HeadRead]:
    """What rank ``rank`` of a reader at ``size`` ranks reads from senders holding ``shares``
    (the model's heads of each): every head it holds once, from one share holding it (of
    several holding the same heads, one chosen by the rank, spreading the reads)."""
    lo, hi = kv_head_range(num_kv_heads, size, rank)
    holders: dict[Heads, list[int]] = {}
    for i, heads in enumerate(shares):
        holders.setdefault(heads, []).append(i)
    reads = []
    for (start, stop), ranks in sorted(holders.items()):
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            reads.append(HeadRead(ranks[rank % len(ranks)], (a - start, b - start), (a - lo, b - lo)))
    if sorted(h for r in reads for h in range(*r.dst)) != list(range(hi - lo)):
        raise TransferError("layout", f"the sender's ranks hold KV heads {sorted(holders)}: not heads "
                                      f"{lo}..{hi - 1} once each, as rank {rank} of {size} needs")
    return reads


@runtime_checkable
class RankPeer(Protocol):
    """Rank r > 0 of this worker as its transfers see it (``cluster.rank_actors.RayRankPeer``:
    calls to the rank's actor)."""

    def offer(self) -> Any:
        """Its backend's payload with no blocks (blocking; once, as the worker starts)."""

    async def pull_heads(self, meta: TransferMeta, reads: list[tuple[Any, Heads, Heads]], block_ids: list[int]) -> None:
        """Read each (payload, src, dst) into ``block_ids`` of its cache; raises ``TransferError``."""

    async def checksums(self, block_ids: list[int], heads: tuple[int, int]) -> tuple[int, ...]:
        """Its share's sums of ``block_ids`` (``heads``: its first head and the model's count)."""

    async def stats(self) -> dict[str, Any]:
        """Its backend's ``TransferStats`` as a dict."""


@runtime_checkable
class HasRankPeers(Protocol):
    """Rank 0's side of a rank group that can hand its other ranks to the transfers."""

    def transfer_peers(self, transfer: Any) -> list[RankPeer]: ...


class KVRanks:
    """A worker's ranks as its transfers see them: rank 0's K and V, its other ranks
    (``peers``), and the heads each holds. At one rank each call is the backend's own read,
    offer or sum; above one (or reading a sharded offer) the module docstring's way."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int, size: int = 1,
                 peers: Sequence[RankPeer] = ()) -> None:
        self.k, self.v = k, v
        self.num_kv_heads = num_kv_heads
        self.size = size
        self.heads = [kv_head_range(num_kv_heads, size, r) for r in range(size)]
        self.peers = list(peers)
        self._offers = [peer.offer() for peer in self.peers]
        # A group whose ranks cannot move KV (ranks started without endpoints: colocated).
        self.reason = "" if len(self.peers) == size - 1 and all(o is not None for o in self._offers) else (
            f"this worker's {size} ranks have no transfer endpoints of their own (only nixl reads a rank's share)")

    def _check_can_move(self, meta: TransferMeta) -> None:
        if self.reason:
            raise TransferError("layout", f"transfer {meta.transfer_id}: {self.reason}")

    def offer(self, backend: KVTransferBackend, meta: TransferMeta, block_ids: list[int]) -> Any:
        """Sender: the payload of ``block_ids`` (one share a rank above one rank)."""
        if self.size > 1:
            self._check_can_move(meta)
        payload = backend.prepare_blocks(meta, block_ids)
        if self.size == 1:
            return payload
        others = [dataclasses.replace(offer, block_ids=tuple(block_ids)) for offer in self._offers]
        shares = (RankShare(h, p) for h, p in zip(self.heads, [payload, *others], strict=True))
        return ShardedPayload(self.num_kv_heads, tuple(shares))

    async def read(self, backend: KVTransferBackend, meta: TransferMeta, payload: Any, block_ids: list[int]) -> None:
        """Receiver: every rank reads its heads of the offer into ``block_ids``, all at
        once; returns when every read has ended, raising the worst failure if any."""
        if self.size == 1 and not isinstance(payload, ShardedPayload):
            await backend.pull_blocks_async(meta, payload, block_ids)
            return
        self._check_can_move(meta)
        offer = self._header(meta, payload)
        held = [share.heads for share in offer.shares]
        plans = [read_plan(self.num_kv_heads, held, self.size, r) for r in range(self.size)]  # all checked first

        here = [backend.pull_heads_async(meta, offer.shares[r.share].payload, block_ids, r.src, r.dst)
                for r in plans[0]]  # each share's read on a thread of its own
        asked = [peer.pull_heads(meta, [(offer.shares[r.share].payload, r.src, r.dst) for r in plan], block_ids)
                 for peer, plan in zip(self.peers, plans[1:], strict=True)]
        outcomes = await asyncio.gather(*here, *asked, return_exceptions=True)
        if errors := [e for e in outcomes if isinstance(e, BaseException)]:
            raise worst(errors)

    def _header(self, meta: TransferMeta, payload: Any) -> ShardedPayload:
        """The offer as shares, checked against this side's layout (nothing read before)."""
        if not isinstance(payload, ShardedPayload):  # a sender at one rank: all heads in one share
            payload = ShardedPayload(self.num_kv_heads, (RankShare((0, self.num_kv_heads), payload),))
        if payload.num_kv_heads != self.num_kv_heads or not payload.shares:
            raise TransferError("layout", f"transfer {meta.transfer_id}: the sender shards {payload.num_kv_heads} "
                                          f"KV heads over {len(payload.shares)} ranks, this model has "
                                          f"{self.num_kv_heads}")
        for share in payload.shares:
            start, stop = share.heads
            held = getattr(share.payload, "heads", stop - start)
            if not 0 <= start < stop <= self.num_kv_heads or held != stop - start:
                raise TransferError("layout", f"transfer {meta.transfer_id}: a sender rank claims heads "
                                              f"{share.heads} with {held} in its cache")
        return payload

    async def checksums(self, block_ids: list[int]) -> tuple[int, ...]:
        """One sum a block over every rank's heads (ranks holding the same heads must agree)."""
        loop = asyncio.get_running_loop()
        first, total = self.heads[0][0], self.num_kv_heads
        here = loop.run_in_executor(None, block_checksums, self.k, self.v, block_ids,
                                    (first, total) if self.size > 1 else None)
        sums = await asyncio.gather(here, *(peer.checksums(block_ids, (h[0], total))
                                            for peer, h in zip(self.peers, self.heads[1:], strict=True)))
        if len(sums) == 1:
            return tuple(sums[0])
        by_heads: dict[Heads, tuple[int, ...]] = {}
        for heads, got in zip(self.heads, sums, strict=True):
            if by_heads.setdefault(heads, tuple(got)) != tuple(got):
                raise TransferError("checksum", f"the ranks holding KV heads {heads} hold different KV")
        return tuple(sum(column) & _MASK for column in zip(*by_heads.values(), strict=True))

    async def stats(self) -> list[dict[str, Any]]:
        """Every other rank's transfer counters, in rank order (rank 0's are the worker's own)."""
        return list(await asyncio.gather(*(peer.stats() for peer in self.peers)))


class InProcessPeer:
    """Rank r > 0 living in this process, served as a rank actor serves its rank (a worker's
    ranks are Ray actors, ``cluster.rank_actors``; benchmarks and tests put a worker's ranks
    in one process, each with its own backend over its own share of a cache). ``fail``: what
    its next reads raise instead of reading."""

    def __init__(self, backend: KVTransferBackend, k: torch.Tensor, v: torch.Tensor) -> None:
        self.backend, self.k, self.v = backend, k, v
        self.fail: BaseException | None = None

    def offer(self) -> Any:
        return getattr(self.backend, "offer", lambda: None)()

    async def pull_heads(self, meta: TransferMeta, reads: list[tuple[Any, Heads, Heads]], block_ids: list[int]) -> None:
        if self.fail is not None:
            raise self.fail
        outcomes = await asyncio.gather(*(self.backend.pull_heads_async(meta, payload, block_ids, src, dst)
                                          for payload, src, dst in reads), return_exceptions=True)
        if errors := [e for e in outcomes if isinstance(e, BaseException)]:
            raise worst(errors)

    async def checksums(self, block_ids: list[int], heads: tuple[int, int]) -> tuple[int, ...]:
        return block_checksums(self.k, self.v, block_ids, heads)

    async def stats(self) -> dict[str, Any]:
        return self.backend.stats.as_dict()


def worst(errors: Sequence[BaseException]) -> BaseException:
    """The failure that speaks for several ranks' reads: one that could not be cancelled
    (its blocks must wait for every such read to settle), else the first transfer error,
    else the first error."""
    stuck = [e for e in errors if isinstance(e, TransferError) and e.reason == "stuck"]
    if stuck:
        settled = [f for e in stuck if (f := getattr(e, "settled", None)) is not None]
        if len(settled) < len(stuck):
            stuck[0].settled = None  # one read may never say it ended: the blocks wait for the sender's end
        elif len(settled) > 1:
            stuck[0].settled = asyncio.ensure_future(asyncio.gather(*settled, return_exceptions=True))
        return stuck[0]
    return next((e for e in errors if isinstance(e, TransferError)), errors[0])
