"""The simulated router's placement: the dispatcher's own ``router.worker_loads.WorkerLoads``
over the simulated workers.

The calls are the dispatcher's (``router.dispatch.Dispatcher._choose_decode``,
``_choose_prefill`` and ``_prefill_here``), minus what only a live service has (stale
load reports, affinities of ``n`` > 1, workers that died). A simulated worker's report is
always current: each placement notes every worker's load as of ``now`` first. A
reservation waits for the decode worker's step to end, as the live call does, and its
blocks count as pending there until it is answered (``reserved``); a prefill's tokens are
in the worker's own report from the moment it is queued (``prefill_queued``).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from router.worker_loads import WorkerLoads
from sim.topology import RouterSettings
from sim.worker import SimWorker


class SimRouter:
    """Placement state of one router replica (a ``WorkerLoads``), over the simulator's pools
    (a dict of role to live ``SimWorker`` lists, shared, not copied)."""

    def __init__(self, settings: RouterSettings, decode_engine: EngineConfig, pools: dict[str, list[SimWorker]]):
        self.settings = settings
        self.block_size = decode_engine.block_size
        seed = decode_engine.prefix_hash_seed if decode_engine.prefix_hash_seed is not None else 0
        self._hasher = BlockHasher(decode_engine.prefix_hash_algo, seed)
        self.loads = WorkerLoads(settings.dispatch_config(decode_engine))
        self.pools = pools
        self._uses_prefixes = settings.placement != "round_robin" and settings.prefix_affinity
        self._hashed: tuple[Sequence[int] | None, list[bytes]] = (None, [])

    def prefix_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """The prompt's block hashes (the last prompt's kept: both placements of a request ask)."""
        if prompt is not self._hashed[0]:
            self._hashed = (prompt, self._hasher.hash_blocks(prompt, self.block_size) if self._uses_prefixes else [])
        return self._hashed[1]

    def choose_decode(self, prompt: list[int], now: float) -> tuple[SimWorker, int] | None:
        """A decode worker with room for the prompt and its first token, and how many of its
        leading blocks that worker likely caches; None when none has room. The prompt's
        blocks count as pending there until ``reserved`` (or ``placed_here``)."""
        workers = self.pools["decode"]
        for w in workers:
            if not w.draining:
                self.loads.note(w.worker_id, w.decode_load(now), now)
        return self.loads.choose_decode(workers, self._blocks(len(prompt)), hashes=self.prefix_hashes(prompt))

    def reserved(self, decode: SimWorker, request) -> None:
        """The reservation reached ``decode`` (taken or refused): its own report counts it now."""
        self.loads.decode_answered(decode.worker_id, self._blocks(request.num_prompt_tokens))

    placed_here = reserved  # a request run whole on its decode worker is in that worker's report at once

    def _blocks(self, num_prompt_tokens: int) -> int:
        """Blocks a prompt and its first token take (the dispatcher's estimate)."""
        return -(-(num_prompt_tokens + 1) // self.block_size)

    def choose_prefill(self, prompt: list[int], now: float) -> SimWorker:
        """The prefill worker for ``prompt`` (least queued, or the one caching its prefix)."""
        workers = self.pools["prefill"]
        for w in workers:
            if not w.draining:
                self.loads.note(w.worker_id, w.prefill_load(), now)
        chosen = self.loads.choose_prefill(workers, len(prompt), self.prefix_hashes(prompt))
        assert chosen is not None, "a simulated prefill pool always has a worker that is not draining"
        return chosen

    def prefill_queued(self, prefill: SimWorker, prompt: list[int]) -> None:
        """The prompt entered ``prefill``'s queue: its report counts the tokens from now on."""
        self.loads.prefill_ended(prefill.worker_id, len(prompt))

    def prefill_here(self, prompt: list[int], held_blocks: int, decode: SimWorker, now: float) -> str | None:
        """Why ``decode`` should compute the prompt itself (``placement.prefill_here``), or None."""
        s = self.settings
        if not (s.local_prefill_tokens or s.local_prefill_backlog_tokens):
            return None
        prefill = [w for w in self.pools["prefill"] if not w.draining]
        for w in prefill:
            self.loads.note(w.worker_id, w.prefill_load(), now)
        return self.loads.prefill_here(prefill, len(prompt), held_blocks, decode.worker_id)

    def gone(self, worker: SimWorker) -> None:
        """``worker`` left its pool: what placement knew of it goes too."""
        if worker.role == "decode":
            self.loads.decode_gone(worker)
        else:
            self.loads.prefill_gone(worker.worker_id)
