"""One simulated worker: the engine's own scheduler and block manager, stepped on simulated time.

``build_scheduler`` wires ``engine.core.block_pool.KVCacheManager`` and
``engine.core.scheduler.Scheduler`` from an ``EngineConfig`` as ``LLMEngine._make_parts``
does (the budget raised to the context without chunked prefill); nothing of them is
copied. A step is the engine's: ``schedule()``, then, once the cost model's time has
passed, ``update()`` with a sampled token for every request the plan samples. No model
runs: generated token ids are a constant that is no stop token (requests ask for a
fixed output length, as the serving benchmark's do).

A worker's step lifecycle::

    idle ──kick (work it can step)──▶ stepping (plan in flight until busy_until)
      ▲                                   │
      └──── step done: update(), kick ◀───┘
    a plan with nothing in it (no blocks for anyone) leaves the worker idle until the
    next arrival or freed blocks kick it

A decode worker whose next steps are all one pure decode step (``Scheduler.decode_run``:
everything running decodes, nothing waits, nobody ends) takes them as one **run**: their
times are computed at once, and the scheduler skips them (``skip_decode_steps``) when the
run ends or something touches the worker mid-run; its load reports meanwhile are what the
steps so far would leave (blocks taken by every step begun). The outcome is the same as
stepping one plan at a time (``tests/unit/test_sim_runs.py``), but for an event at the
very instant a step ends, which a run sees before that step's end (stepping, it depends
on which of the two was queued first)::

    idle ──kick (a decode run)──▶ in a run ──last step's end──▶ steps skipped, kick
                                     │
         a request placed here or its KV arriving: the steps ended are skipped, the
         one under way is planned (``schedule``) and in flight as any other

Draining (autoscaling): a draining worker takes no new requests and leaves its pool
once it holds none.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from engine.core.block_pool import KVCacheManager
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.wire.messages import DecodeLoad, PrefillLoad

if TYPE_CHECKING:
    from sim.cost import CostModel

SAMPLED_TOKEN = 3  # what every simulated step samples: never a stop token (ignore_eos)


def build_scheduler(config: EngineConfig, num_blocks: int, num_cpu_blocks: int,
                    max_model_len: int) -> tuple[KVCacheManager, Scheduler]:
    """The block manager and scheduler an ``LLMEngine`` with ``config`` builds."""
    kv_manager = KVCacheManager(
        num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks,
        BlockHasher(config.prefix_hash_algo, config.prefix_hash_seed if config.prefix_hash_seed is not None else 0),
    )
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        budget = max(budget, max_model_len)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
            policy=config.policy,
            batching=config.batching,
        ),
        kv_manager,
    )
    return kv_manager, scheduler


@dataclass(slots=True)
class DecodeRun:
    """Identical decode steps a worker takes as one: each step's end time and duration (float64
    arrays), the blocks steps 1 to j + 1 take in all (``taken[j]``, from
    ``Scheduler.decode_run``), the free blocks before the first, and the requests decoding."""

    ends: np.ndarray
    durations: np.ndarray
    taken: list[int]
    free_blocks: int
    requests: list

    def steps_ended(self, now: float) -> int:
        """Steps ended before ``now`` (one ending at ``now`` has not yet)."""
        return int(np.searchsorted(self.ends, now, "left"))


class SimWorker:
    """A prefill or decode worker of the simulated cluster: its scheduler, the plan in flight, the
    counters the autoscaler's observation reads, its link's next free time, and the cost model
    of its steps (``cost``: at its ``tensor_parallel_size``)."""

    def __init__(self, worker_id: str, role: str, config: EngineConfig, num_blocks: int, num_cpu_blocks: int,
                 max_model_len: int, cost: CostModel | None = None) -> None:
        self.worker_id = worker_id
        self.cost = cost
        self.role = role
        self.config = config
        self.max_model_len = max_model_len
        self.kv, self.scheduler = build_scheduler(config, num_blocks, num_cpu_blocks, max_model_len)
        self.in_flight: SchedulerOutput | None = None
        self.draining = False
        self.link_free_at = 0.0  # when this worker's link is next free (transfers queue on it)
        self.prompt_tokens = 0  # prompt tokens taken in (the autoscaler's prefill rate)
        self.forward_s = 0.0  # simulated model time, summed over steps
        self.num_steps = 0
        self.run: DecodeRun | None = None
        self.calls: list = []  # (fn, arg) sent while a step was under way: run once it has ended
        self.load: DecodeLoad | None = None  # the last report, good until ``load_until``
        self.load_until = -math.inf  # (until the worker changes; in a run, until a step takes blocks)
        self._prefill_load: PrefillLoad | None = None

    @property
    def key(self) -> str:
        """The incarnation placement tells apart (``WorkerRef.key``): a simulated worker's id
        is never reused."""
        return self.worker_id

    def touch(self) -> None:
        """The worker's state changed: its next load report is made anew."""
        self.load = self._prefill_load = None
        self.load_until = -math.inf

    def holds_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self.scheduler.held) or self.in_flight is not None
                or self.run is not None or bool(self.calls))

    def free_blocks(self, now: float) -> int:
        """Free KV blocks at ``now``: in a run, less what the steps begun by then took."""
        run = self.run
        if run is None:
            return self.kv.pool.num_free_blocks
        return run.free_blocks - run.taken[run.steps_ended(now)]

    def kv_usage(self, now: float) -> float:
        usable = self.kv.pool.num_usable_blocks
        return (usable - self.free_blocks(now)) / usable

    def decode_load(self, now: float) -> DecodeLoad:
        """The load report a decode worker sends with every step message (``load``, kept
        while it holds: placement reads it for every worker, for every request)."""
        if self.load is None or now > self.load_until:
            s, run = self.scheduler, self.run
            self.load_until = math.inf
            if run is not None:  # good until the last step of those that take no more blocks than this one
                taken = run.taken
                self.load_until = float(run.ends[bisect_right(taken, taken[run.steps_ended(now)]) - 1])
            self.load = DecodeLoad(self.worker_id, self.free_blocks(now), self.kv.pool.num_usable_blocks,
                                   len(s.running), s.num_waiting, len(s.remote))
        return self.load

    def prefill_load(self) -> PrefillLoad:
        """The load report a prefill worker answers placement polls with."""
        if self._prefill_load is None:
            s = self.scheduler
            self._prefill_load = PrefillLoad(self.worker_id, s.num_queued_tokens(), len(s.running), s.num_waiting,
                                             self.kv.stats.queries, self.kv.stats.hits, len(s.held))
        return self._prefill_load

    def stats(self) -> dict:
        """The engine counters the pools' control loop reads (``EngineStats``' names)."""
        return {"prompt_tokens": self.prompt_tokens, "num_steps": self.num_steps, "forward_s": self.forward_s}
