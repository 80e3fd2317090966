"""The device's paged KV blocks: ``KVBlock``, the null block id and ``BlockPool``, which
hands blocks out, counts their references, orders the free ones for eviction and indexes
the cached prefixes.

Pure Python: integers and small objects only, no torch. The per-request block tables
are built on this pool by ``engine.core.block_pool.KVCacheManager`` (which re-exports the
names here); the host side (swap space, host tier) is ``engine.core.host_tier``.

Block lifecycle::

    free (ref 0, maybe hashed) ──allocate/touch──▶ in use (ref >= 1) ──free──▶ free
    a free block that still carries a hash is a prefix-cache entry until it is
    evicted: ``allocate`` takes blocks from the head of the free queue, oldest first,
    and drops their hash; with a host tier (``engine.core.host_tier``) the evicted
    prefix is spilled there first.

Block 0 is the null block: never handed out, used to pad block tables.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.core.block_hash import BlockHash
from engine.core.host_tier import HostTier

NULL_BLOCK_ID = 0  # never handed out; in a block table, the place of a block given back (release_outside_window)


class KVBlock:
    """One block of KV memory: an id, a reference count and an optional prefix hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={digest})"


class BlockPool:
    """Ref-counted blocks, an eviction-ordered free queue and the prefix-cache index;
    ``host_tier`` (optional) keeps what eviction drops."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, host_tier: HostTier | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.host_tier = host_tier
        # The blocks handed out so far, by id (the null block, then in the order first
        # handed out: ids ascend). The free queue starts as every other id in order, and
        # given-back blocks join its tail, so the ids never handed out are always its
        # head: they are made on first use (a pool of 27k blocks per device took a
        # simulated cluster seconds and gigabytes to build up front).
        self.blocks = [KVBlock(NULL_BLOCK_ID)]
        # Blocks given back, behind the never-used ones: insertion order is eviction order.
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self.blocks)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - 1 - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that stand for a cached prefix (free or in use)."""
        return len(self._cached)

    def allocate(self, n: int, spill: bool = True) -> list[KVBlock] | None:
        """Take ``n`` blocks from the head of the free queue, or None if there are fewer.

        An evicted block's prefix goes to the host tier (``spill``; the copy joins the plan
        being made, so it runs before anything writes the block) or is dropped.
        """
        blocks = self.blocks
        fresh = min(n, self.num_blocks - len(blocks))  # never handed out: the head of the queue
        if n - fresh > len(self._free):
            return None
        out = [KVBlock(i) for i in range(len(blocks), len(blocks) + fresh)]
        for block in out:
            block.ref_cnt = 1
        blocks.extend(out)
        for _ in range(n - fresh):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                # Evicting a cached block: it no longer stands for its prefix here.
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    if spill and self.host_tier is not None:
                        self.host_tier.spill(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (a prefix hit), pulling free ones out."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in eviction order (first freed, first evicted)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its prefix hash (the first copy wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
