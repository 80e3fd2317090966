"""The host tier behind the device prefix cache: evicted prefix blocks kept in host memory.

Pure Python (no torch), like the block pool it serves: block ids and hashes only. The
bytes live in the host half of ``engine.model.kv_cache.KVCache`` (``cpu_k``/``cpu_v``),
which swap preemption uses too: one host pool (``CpuBlockPool``) holds both swapped-out
requests' blocks and the tier's entries. The tier keeps at most ``capacity`` entries;
swap takes any free host block and, when none is left, the tier's least recently used
entries give way to it (swap space in use is never taken by the tier).

An entry's lifecycle::

    device block, hashed, evicted ──spill──▶ entry (a host block, most recently used)
        (a (device, host) copy in the step's plan; none when the hash has an entry already)
    entry ──restore──▶ a fresh device block, hashed again (a (host, device) copy)
        the entry stays, most recently used: evicting that device block later copies nothing
    entry ──dropped (least recently used: a spill needs room, or swap needs its block)──▶ free

The copies run after planning, in the order ``engine.model.model_runner`` executes a
step: device -> host (spills, swap-outs), then host -> device (restores, swap-ins), then
the forward. So within one plan a host block may be written once and never after a read
of it: an entry spilled or restored by a plan is pinned (not dropped) until the next
plan begins, and swap blocks a swap-in reads stay out of the free pool until then too.

A plan's lifecycle here: ``begin_step`` (the previous plan has run: its pins and held
blocks go), then spills and restores while the scheduler plans, then ``take_copies``
(they join the plan).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.block_hash import BlockHash


class CpuBlockPool:
    """Host block ids, free or taken: swap space and the host tier's entries draw on it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free block ids, or None (and none taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        self._free.extend(block_ids)


@dataclass(frozen=True, slots=True)
class HostHit:
    """A prefix block found in the host tier, not on the device: its request's table gets a
    fresh device block for it, restored from the tier in the step that lets the request in."""

    block_hash: BlockHash


@dataclass
class HostTierStats:
    """The tier's counters since it was made, in blocks; the engine reports them in ``stats()``."""

    spills: int = 0  # device -> host copies of evicted prefix blocks
    restores: int = 0  # host -> device copies: prefix blocks served from the tier
    dropped: int = 0  # entries dropped, least recently used, for a newer one or for swap
    lost: int = 0  # evicted prefix blocks not kept: every host block was pinned or swap space


@dataclass
class _Fence:
    """Host blocks one plan's copies touch: pinned entries, and swap blocks read and given back."""

    pinned: set[int] = field(default_factory=set)
    held: list[int] = field(default_factory=list)


class HostTier:
    """LRU entries keyed by prefix hash over a shared ``CpuBlockPool``, and the copies that
    fill and read them (see the module docstring). ``capacity`` 0: off (nothing spills)."""

    def __init__(self, host_pool: CpuBlockPool, capacity: int = 0) -> None:
        if not 0 <= capacity <= host_pool.num_blocks:
            raise ValueError(f"host tier capacity must be in [0, {host_pool.num_blocks}] blocks "
                             f"(the host pool's size), got {capacity}")
        self.host_pool = host_pool
        self.capacity = capacity
        self.stats = HostTierStats()
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._now = _Fence()  # of the plan being made (or of work between plans)
        self._planned = _Fence()  # of the plan taken last, which runs before the next begins
        self._spills: list[tuple[int, int]] = []  # (device, host), for the next plan
        self._restores: list[tuple[int, int]] = []  # (host, device), for the next plan

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_held(self) -> int:
        """Swap blocks given back whose read is still planned: free once the plan has run."""
        return len(self._now.held) + len(self._planned.held)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    # -- entries ---------------------------------------------------------------

    def spill(self, device_id: int, block_hash: BlockHash) -> None:
        """Keep an evicted device block's prefix: a (device, host) copy for the plan, or
        none when the hash has an entry already (it only becomes most recently used)."""
        if not self.capacity:
            return
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        host = self._free_block()
        if host is None:
            self.stats.lost += 1
            return
        self._entries[block_hash] = host
        self._now.pinned.add(host)
        self._spills.append((device_id, host))
        self.stats.spills += 1

    def pin(self, block_hash: BlockHash) -> int:
        """Keep the entry until the plan that restores it has run (before a device block is
        taken for it: that allocation's spills must not drop it); its host block id.
        KeyError when the hash has no entry."""
        host = self._entries[block_hash]
        self._entries.move_to_end(block_hash)
        self._now.pinned.add(host)
        return host

    def restore(self, host: int, device_id: int) -> None:
        """Copy a pinned entry's block into ``device_id`` in the next plan (the entry stays)."""
        self._restores.append((host, device_id))
        self.stats.restores += 1

    def _pinned(self) -> set[int]:
        return self._now.pinned | self._planned.pinned

    def _droppable(self) -> int:
        return len(self._entries) - len(self._pinned())

    def _drop_lru(self) -> int | None:
        """Drop the least recently used entry no plan pins; its host block (not freed)."""
        pinned = self._pinned()
        victim = next((h for h, host in self._entries.items() if host not in pinned), None)
        if victim is None:
            return None
        self.stats.dropped += 1
        return self._entries.pop(victim)

    def _free_block(self) -> int | None:
        """A host block for a new entry: a free one while the tier is under its capacity,
        else the least recently used unpinned entry's."""
        if len(self._entries) < self.capacity:
            got = self.host_pool.allocate(1)
            if got:
                return got[0]
        return self._drop_lru()

    # -- swap space ------------------------------------------------------------

    def take_swap(self, n: int) -> list[int] | None:
        """``n`` host blocks for a swap-out, dropping unpinned entries (least recently used
        first) if the free ones are too few; None, and nothing dropped, if that is not enough."""
        short = n - self.host_pool.num_free_blocks
        if short > 0:
            if short > self._droppable():
                return None
            for _ in range(short):
                host = self._drop_lru()
                assert host is not None  # counted above
                self.host_pool.free([host])
        return self.host_pool.allocate(n)

    def give_back_swap(self, block_ids: list[int]) -> None:
        """Swap blocks a swap-in reads in the plan being made: free once it has run (a spill
        planned after it would write them first); at once when the tier is off."""
        if self.capacity:
            self._now.held.extend(block_ids)
        else:
            self.host_pool.free(block_ids)

    # -- plans -----------------------------------------------------------------

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The spills (device, host) and restores (host, device) since the last plan, for
        the plan being made; what they pin stays pinned until the next ``begin_step``."""
        spills, restores = self._spills, self._restores
        self._spills, self._restores = [], []
        self._planned.pinned |= self._now.pinned
        self._planned.held += self._now.held
        self._now = _Fence()
        return spills, restores

    def begin_step(self) -> None:
        """The last plan taken has run: its pins end and the swap blocks it read are free."""
        self.host_pool.free(self._planned.held)
        self._planned = _Fence()
