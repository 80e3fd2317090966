"""The paged KV block pool and the per-request block tables built on it (``KVCacheManager``).

Pure Python: integers and small objects only, no torch. The tensors that hold the
blocks' contents live in ``engine.model.kv_cache``; this module decides which block ids
each request owns. The pool itself (``KVBlock``, ``BlockPool``, ``NULL_BLOCK_ID``: ref
counts, the eviction-ordered free queue, the prefix-cache index) is
``engine.core.kv_blocks``, importable from here too; the host side (swap space and the
host tier) is ``engine.core.host_tier``.

Block lifecycle (``engine.core.kv_blocks``)::

    free (ref 0, maybe hashed) ──allocate/touch──▶ in use (ref >= 1) ──free──▶ free
    a free block that still carries a hash is a prefix-cache entry until it is
    evicted: ``allocate`` takes blocks from the head of the free queue, oldest first,
    and drops their hash; with a host tier (``engine.core.host_tier``) the evicted
    prefix is spilled there first, and a later lookup that runs past the device's hits
    goes on in the tier: those blocks are restored into fresh device blocks.

Block 0 is the null block: never handed out, used to pad block tables.
Full blocks are identified by a chained hash (the parent block's hash and this
block's token ids: ``engine.core.block_hash``), so equal hashes mean equal prefixes, and a
prefix hit is the longest run of leading blocks whose hashes are cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_hash import BlockHash, BlockHasher
from engine.core.host_tier import CpuBlockPool, HostHit, HostTier
from engine.core.kv_blocks import NULL_BLOCK_ID, BlockPool, KVBlock
from engine.core.request import Request

# The pool's names live in engine.core.kv_blocks (CpuBlockPool in engine.core.host_tier);
# importers name them here.
__all__ = ["NULL_BLOCK_ID", "BlockPool", "CpuBlockPool", "KVBlock", "KVCacheManager", "PrefixBlock",
           "PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """The prefix cache's counters since the manager was made, counted once a request is let in;
    the engine reports them in its load and stats."""

    queries: int = 0  # tokens of admitted requests looked up
    hits: int = 0  # of those, tokens served from the cache (either tier)
    host_hits: int = 0  # of the hits, tokens restored from the host tier


# A block of a prefix-cache hit: on the device, or in the host tier (restored on admission).
PrefixBlock = KVBlock | HostHit


class KVCacheManager:
    """Owns each request's block table on top of a ``BlockPool`` (and a swap pool).

    A block table is a list of block ids (what every step hands the runner); the pool's
    ``blocks`` list turns an id back into its ``KVBlock`` when references change.
    ``hasher`` names full blocks in the prefix cache; by default a ``BlockHasher`` of
    the default algorithm with a random seed of its own.

    ``window`` > 0: every layer attends to at most that many latest keys (a model whose
    layers all slide), so a block whose tokens are all further back than that is never
    read again: ``release_outside_window`` gives it back to the pool (still in the prefix
    cache until evicted) and leaves ``NULL_BLOCK_ID`` in its place in the table, which keeps
    its positions; the attention masks read nothing there.

    ``num_cpu_blocks`` host blocks hold swapped-out requests and, up to
    ``host_cache_blocks`` of them, the host tier (``engine.core.host_tier``; 0: off, and
    off without caching), where evicted prefix blocks go and lookups continue. The
    copies both make join the step's plan: the scheduler calls ``begin_step`` before it
    plans and ``take_copies`` once it has.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        hasher: BlockHasher | None = None,
        window: int = 0,
        host_cache_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.window = window
        self._released: dict[str, int] = {}  # request id -> leading table entries given back (NULL_BLOCK_ID)
        self.num_released = 0  # blocks given back from behind the window, in all
        self.block_size = block_size
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.host_tier = HostTier(self.cpu_pool, host_cache_blocks if enable_caching else 0)
        self.pool = BlockPool(num_blocks, enable_caching, self.host_tier)
        self.enable_caching = enable_caching
        self.hasher = hasher or BlockHasher()
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks already registered
        self._cpu_blocks: dict[str, list[int]] = {}

    # -- queries ---------------------------------------------------------------

    def has_table(self, request_id: str) -> bool:
        """The request holds blocks (on the device or in swap space)."""
        return request_id in self._tables or request_id in self._cpu_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy), in token order."""
        table = self._tables.get(request_id)
        return table[:] if table else []

    def num_table_blocks(self, request_id: str) -> int:
        """Entries in the request's block table."""
        return len(self._tables.get(request_id, ()))

    def _held(self, table: Sequence[int]) -> list[KVBlock]:
        blocks = self.pool.blocks
        return [blocks[i] for i in table if i != NULL_BLOCK_ID]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_in_pool(self, num_tokens: int) -> bool:
        return self.num_blocks_needed(num_tokens) <= self.pool.num_usable_blocks

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as tokens arrive."""
        hashes = self._hashes.setdefault(request.request_id, [])
        n_full = request.num_tokens // self.block_size
        if len(hashes) < n_full:
            tokens = request.token_slice(len(hashes) * self.block_size, n_full * self.block_size)
            parent = hashes[-1] if hashes else self.hasher.adapter_root(request.adapter)  # per adapter
            hashes.extend(self.hasher.hash_blocks(tokens, self.block_size, parent))
        return hashes

    def get_computed_blocks(self, request: Request, device_only: bool = False) -> tuple[list[PrefixBlock], int]:
        """Longest cached prefix of a new request, capped so one token is left to compute.

        Whole blocks only, each on the device (a ``KVBlock``) or, past a device miss, in the
        host tier (a ``HostHit``, restored by ``allocate_slots``); ``device_only`` looks in
        the device's cache alone. A lookup, not a use: ``count_prefix_lookup`` counts it
        once the request is let in. A request that wants its prompt's logprobs computes
        every prompt token (a cached token has no logits), as in vLLM; its blocks are
        still cached for others.
        """
        if (
            not self.enable_caching
            or request.num_computed_tokens > 0
            or request.sampling_params.prompt_logprobs is not None
        ):
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tier = None if device_only or not self.host_tier.capacity else self.host_tier
        hit: list[PrefixBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is not None:
                hit.append(block)
            elif tier is not None and tier.holds(h):
                hit.append(HostHit(h))
            else:
                break
        return hit, len(hit) * self.block_size

    def host_tokens(self, hit: Sequence[PrefixBlock]) -> int:
        """Tokens of a ``get_computed_blocks`` hit that come from the host tier."""
        return self.block_size * sum(1 for b in hit if isinstance(b, HostHit))

    def count_prefix_lookup(self, num_tokens: int, num_hit: int, num_host_hit: int = 0) -> None:
        """A request was let in with ``num_hit`` of its ``num_tokens`` from the cache,
        ``num_host_hit`` of them from the host tier."""
        if self.enable_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit
            self.stats.host_hits += num_host_hit

    # -- allocation ------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[PrefixBlock] = (),
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) if it can't.

        ``new_computed_blocks``: a new request's prefix hit (``get_computed_blocks``); each
        ``HostHit`` takes a fresh device block, restored in this step's plan before its
        forward reads it, and hashed on the device at once (its entry stays in the tier).
        Returns the newly allocated blocks (none when the request's blocks had room).
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            table = self._tables[rid] = []
        num_hit = len(new_computed_blocks)
        num_tokens = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        need = max(0, -(-num_tokens // self.block_size) - len(table) - num_hit)
        if need == 0 and not num_hit:
            return []  # a decode step within its last block: the common case, kept cheap
        on_device = [b for b in new_computed_blocks if isinstance(b, KVBlock)]
        need += num_hit - len(on_device)  # a fresh block for each one restored
        # Cached blocks we are about to reuse may sit in the free queue: they stop
        # being free, so they count against what is left.
        reused_free = sum(1 for b in on_device if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reused_free:
            return None
        self.pool.touch(on_device)
        # Pinned before the allocation below, whose spills must not drop them.
        hosts = [self.host_tier.pin(b.block_hash) for b in new_computed_blocks if isinstance(b, HostHit)]
        new = self.pool.allocate(need) if need > 0 else []
        assert new is not None  # there were enough free blocks
        if num_hit:
            self._take_hit(table, new_computed_blocks, new[: len(hosts)], hosts)
            self._num_hashed[rid] = len(table)
        table.extend(b.block_id for b in new[len(hosts):])
        return new

    def _take_hit(self, table: list[int], hit: Sequence[PrefixBlock], fresh: list[KVBlock], hosts: list[int]) -> None:
        """Append a prefix hit to ``table``: device blocks as they are, the host tier's in
        ``fresh`` blocks (in order), each restored from its pinned host block and hashed."""
        restored = iter(zip(fresh, hosts))
        for entry in hit:
            if isinstance(entry, KVBlock):
                table.append(entry.block_id)
                continue
            block, host = next(restored)
            self.pool.cache(block, entry.block_hash)
            self.host_tier.restore(host, block.block_id)
            table.append(block.block_id)

    def reserve_remote(self, request: Request, hit: Sequence[KVBlock]) -> int | None:
        """Blocks for a prompt whose KV another worker sends (decode role); None, and no
        change, when the pool has no room. ``hit``: a device-only lookup's; the blocks
        this evicts are not spilled to the host tier (the KV arrives outside a step's plan).

        With a ``window``, the leading blocks wholly behind it at the prompt's end are read
        by no later step: the table holds ``NULL_BLOCK_ID`` for them (no block is taken, a
        cached one is not reused), then the cached ``hit`` blocks past them, then new ones.
        Returns how many leading table entries need no transfer (cached or behind the window).
        """
        rid = request.request_id
        if rid in self._tables:
            raise ValueError(f"request {rid!r} holds blocks already")
        num_blocks = -(-request.num_tokens // self.block_size)
        behind = max(0, request.num_tokens - self.window) // self.block_size if self.window else 0
        kept = list(hit[behind:])
        not_sent = max(behind, len(hit))
        need = num_blocks - not_sent
        if need > self.pool.num_free_blocks - sum(1 for b in kept if b.ref_cnt == 0):
            return None
        self.pool.touch(kept)
        # No spill: the KV lands in these blocks before the next plan's copies would run.
        new = self.pool.allocate(need, spill=False)
        assert new is not None  # there were enough free blocks
        self._tables[rid] = [NULL_BLOCK_ID] * behind + [b.block_id for b in kept] + [b.block_id for b in new]
        self._num_hashed[rid] = not_sent
        if behind:
            self._released[rid] = behind
            self.num_released += behind
        return not_sent

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        n_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        done = self._num_hashed.get(rid, 0)
        if n_full <= done:
            return
        hashes = self._block_hashes(request)
        table = self._tables[rid]
        blocks = self.pool.blocks
        for i in range(done, n_full):
            if table[i] != NULL_BLOCK_ID:  # (given back, once back from swap space)
                self.pool.cache(blocks[table[i]], hashes[i])
        self._num_hashed[rid] = n_full

    def release_outside_window(self, request: Request) -> int:
        """Give back the request's blocks that no layer reads again (``window``): those
        whose every token is more than ``window`` positions behind the next one to compute.
        Returns how many were given back now."""
        if not self.window:
            return 0
        rid = request.request_id
        table = self._tables.get(rid)
        done = self._released.get(rid, 0)
        if table is None:
            return 0
        upto = min(len(table), max(0, request.num_computed_tokens - self.window) // self.block_size)
        if upto <= done:
            return 0
        self.pool.free(self._held(table[done:upto]))
        table[done:upto] = [NULL_BLOCK_ID] * (upto - done)
        self._released[rid] = upto
        self.num_released += upto - done
        return upto - done

    def free(self, request: Request) -> None:
        """Return every block the request holds, on the GPU pool and in swap space."""
        rid = request.request_id
        self._released.pop(rid, None)
        table = self._tables.pop(rid, None)
        if table:
            # Tail blocks first: they are the least likely to be shared prefixes.
            self.pool.free(reversed(self._held(table)))
        cpu = self._cpu_blocks.pop(rid, None)
        if cpu:
            self.cpu_pool.free(cpu)  # written by an earlier plan, read by none
        self._hashes.pop(rid, None)
        self._num_hashed.pop(rid, None)

    def pin(self, request_id: str) -> list[KVBlock]:
        """Take one more reference to each of the request's blocks; ``unpin`` drops them."""
        blocks = self._held(self._tables.get(request_id, ()))
        self.pool.touch(blocks)
        return blocks

    def unpin(self, blocks: list[KVBlock]) -> None:
        self.pool.free(reversed(blocks))

    # -- swapping --------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to swap space; returns (device, cpu) pairs to copy."""
        rid = request.request_id
        table = self._tables.get(rid, [])
        kept = table[self._released.get(rid, 0):]  # the blocks given back stay so
        cpu = self.host_tier.take_swap(len(kept))  # the tier's entries give way
        if cpu is None:
            return None
        self._tables.pop(rid, None)
        self._num_hashed.pop(rid, None)
        self._cpu_blocks[rid] = cpu
        self.pool.free(reversed(self._held(kept)))
        return list(zip(kept, cpu))

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._cpu_blocks.get(request_id, ()))

    def swap_in(self, request: Request, num_new_tokens: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped request back, with slots for ``num_new_tokens`` more tokens.

        Returns (cpu, device) pairs to copy; None (and no change) if the pool is short.
        """
        rid = request.request_id
        released = self._released.get(rid, 0)
        need = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - released
        new = self.pool.allocate(max(need, self.num_swapped_blocks(rid)))
        if new is None:
            return None
        cpu = self._cpu_blocks.pop(rid)
        self._tables[rid] = [NULL_BLOCK_ID] * released + [b.block_id for b in new]
        self.host_tier.give_back_swap(cpu)
        return list(zip(cpu, (b.block_id for b in new)))

    def num_swap_blocks(self) -> int:
        """Host blocks swapped-out requests hold."""
        return sum(len(c) for c in self._cpu_blocks.values())

    # -- step plans ------------------------------------------------------------

    def begin_step(self) -> None:
        """The last step's plan has run (its copies done): what it pinned in the host tier is free."""
        self.host_tier.begin_step()

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies for the plan being made: spills (device, host), to run
        with its swap-outs, and restores (host, device), to run with its swap-ins."""
        return self.host_tier.take_copies()
