"""The simulated router's placement: ``router.placement``'s policies over the simulated workers.

The calls are the dispatcher's (``router.dispatch.Dispatcher._choose_decode``,
``_choose_prefill`` and ``_prefill_here``), minus what only a live service has (stale
load reports, affinities of ``n`` > 1, workers that died): the loads are the workers'
reports as of their last change. A reservation waits for the decode worker's step to end,
as the live call does; meanwhile its blocks count as pending, as the dispatcher counts them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from router.placement import PrefixIndex, decode_has_room, pick_decode, pick_prefill, prefill_here, round_robin
from sim.topology import RouterSettings
from sim.worker import SimWorker


class _Prefixes:
    """A ``PrefixIndex`` and the first block hash of every prompt it was sent: a worker
    matches nothing of a prompt whose first hash is not among them, so placement skips the
    lookups over every worker for the (many) prompts nobody shares."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self._firsts: set[bytes] = set()

    def matched(self, workers: list[SimWorker], hashes: list[bytes]) -> list[int]:
        """Each worker's ``matched_blocks``; empty when none can match any."""
        if not hashes or hashes[0] not in self._firsts:
            return []
        return [self.index.matched_blocks(w.worker_id, hashes) for w in workers]

    def record(self, worker: SimWorker, hashes: list[bytes]) -> None:
        self.index.record(worker.worker_id, hashes)
        if hashes:
            self._firsts.add(hashes[0])


class SimRouter:
    """Placement state of one router replica: prefix indexes and tie-break counters, over the
    simulator's pools (a dict of role to live ``SimWorker`` lists, shared, not copied)."""

    def __init__(self, settings: RouterSettings, decode_engine: EngineConfig, pools: dict[str, list[SimWorker]]):
        self.settings = settings
        self.block_size = decode_engine.block_size
        self.max_running = decode_engine.max_num_seqs
        seed = decode_engine.prefix_hash_seed if decode_engine.prefix_hash_seed is not None else 0
        self._hasher = BlockHasher(decode_engine.prefix_hash_algo, seed)
        self.pools = pools
        self._prefixes = _Prefixes()
        self._decode_prefixes = _Prefixes()
        self._decode_ties = itertools.count()
        self._prefill_ties = itertools.count()
        self._uses_prefixes = settings.placement != "round_robin" and settings.prefix_affinity
        self._hashed: tuple[Sequence[int] | None, list[bytes]] = (None, [])
        self._pending = 0  # blocks placed and not yet reserved, over every decode worker

    def prefix_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """The prompt's block hashes (the last prompt's kept: both placements of a request ask)."""
        if prompt is not self._hashed[0]:
            self._hashed = (prompt, self._hasher.hash_blocks(prompt, self.block_size) if self._uses_prefixes else [])
        return self._hashed[1]

    def choose_decode(self, prompt: list[int], now: float) -> tuple[SimWorker, int] | None:
        """A decode worker with room for the prompt and its first token, and how many of its
        leading blocks that worker likely caches; None when none has room."""
        workers = [w for w in self.pools["decode"] if not w.draining]
        blocks = self._blocks(len(prompt))
        loads = [w.load if now <= w.load_until else w.decode_load(now) for w in workers]
        hashes = self.prefix_hashes(prompt)
        pending = [w.pending_blocks for w in workers] if self._pending else ()
        if self.settings.placement == "round_robin":
            room = [decode_has_room(load, blocks, self.max_running, p)
                    for load, p in itertools.zip_longest(loads, pending, fillvalue=0)]
            i = round_robin(len(workers), next(self._decode_ties), room)
        else:
            cached = self._decode_prefixes.matched(workers, hashes)
            i = pick_decode(loads, blocks, self.max_running, pending, next(self._decode_ties), cached,
                            self.settings.max_imbalance_requests)
        if i is None:
            return None
        chosen = workers[i]
        held = self._decode_prefixes.index.matched_blocks(chosen.worker_id, hashes) if hashes else 0
        if hashes:
            self._decode_prefixes.record(chosen, hashes)
        return chosen, held

    def pending(self, decode: SimWorker, request) -> None:
        """``request`` was placed on ``decode``; its reservation is on its way there."""
        n = self._blocks(request.num_prompt_tokens)
        decode.pending_blocks += n
        self._pending += n

    def reserved(self, decode: SimWorker, request) -> None:
        """The reservation reached ``decode`` (taken or refused): its own report counts it now."""
        n = self._blocks(request.num_prompt_tokens)
        decode.pending_blocks -= n
        self._pending -= n

    def _blocks(self, num_prompt_tokens: int) -> int:
        """Blocks a prompt and its first token take (the dispatcher's estimate)."""
        return -(-(num_prompt_tokens + 1) // self.block_size)

    def choose_prefill(self, prompt: list[int]) -> SimWorker:
        """The prefill worker for ``prompt`` (least queued, or the one caching its prefix)."""
        workers = [w for w in self.pools["prefill"] if not w.draining]
        hashes = self.prefix_hashes(prompt)
        if self.settings.placement == "round_robin":
            i = round_robin(len(workers), next(self._prefill_ties))
        else:
            loads = [w.prefill_load() for w in workers]
            cached = [n * self.block_size for n in self._prefixes.matched(workers, hashes)]
            i = pick_prefill(loads, (), next(self._prefill_ties), cached, self.settings.max_imbalance_tokens)
        chosen = workers[i]
        self._prefixes.record(chosen, hashes)
        return chosen

    def prefill_here(self, prompt: list[int], held_blocks: int, decode: SimWorker, now: float) -> str | None:
        """Why ``decode`` should compute the prompt itself (``placement.prefill_here``), or None."""
        s = self.settings
        prefill = [w for w in self.pools["prefill"] if not w.draining]
        if not (s.local_prefill_tokens or s.local_prefill_backlog_tokens) or not prefill:
            return None
        queues = [w.prefill_load().queued_prefill_tokens for w in prefill]
        uncached = len(prompt) - min(held_blocks * self.block_size, len(prompt))
        return prefill_here(uncached, queues, decode.decode_load(now), s.local_prefill_tokens,
                            s.local_prefill_backlog_tokens)
