"""The pools' calls to their worker actors, none of the pools' state: starting a worker's
actor in its bundle, telling one to drain and waiting for it to hold nothing, pinging the
listed workers and asking them for their status and loads, telling the decode workers a
prefill worker is gone, and dropping a gone worker's gauges.

``cluster.pools`` decides which worker each call is for (under its lock) and makes the
calls outside it; a worker that does not answer within ``PING_TIMEOUT_S`` counts as
silent: dead or hung, which the pools' health thread sees to.
"""

from __future__ import annotations

import dataclasses
import os
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig, Resources
from cluster.metrics_server import ENV as METRICS_ENV
from cluster.pool_worker import PoolWorker
from cluster.rank_actors import RayRankGroup
from decode_worker.worker import ColocatedWorker
from engine.wire.messages import WorkerRef

PING_TIMEOUT_S = 10.0


def start_actor(cfg: ClusterConfig, role: str, worker_id: str, name: str, pg: object, bundle: int) -> WorkerRef:
    """Start the actor named ``name`` for worker ``worker_id`` in bundle ``bundle`` of
    ``pg``: a ``PoolWorker`` in its role (one that can switch roles later) in a prefill or
    decode pool, a ``ColocatedWorker`` otherwise. Above one rank it also gets what starts
    its other ranks in the group's next bundles."""
    resources: Resources = cfg.resources(role)
    options: dict = {  # the decode role's own, and the other ranks'
        "stream_interval_s": cfg.stream_interval_s,
        "token_channel_host": cfg.token_channel_host if cfg.token_channel == "tcp" else None,
        "channel": cfg.channel,
    }
    if (size := cfg.tensor_parallel_size(role)) > 1:
        # Its other ranks, in the next bundles of its group: the actor starts them (and owns them).
        options["ranks"] = RayRankGroup(size, pg, bundle, resources.num_cpus, resources.num_gpus, name)
    if role == "colocated":
        cls, args = ColocatedWorker, (worker_id, cfg.engine_config("decode"))
    else:
        engines = {r: cfg.engine_config(r) for r in ("prefill", "decode")}
        cls, args = PoolWorker, (role, worker_id, engines)
    handle = (
        ray.remote(cls)
        .options(
            name=name,
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            resources=dict(resources.custom),
            max_restarts=0,
            max_concurrency=1000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            ),
        )
        .remote(*args, cfg.transfer, torch_threads=cfg.torch_threads, **options)
    )
    return WorkerRef(worker_id, handle, incarnation=name, epoch=None if role == "colocated" else 0)


def is_idle(stats: dict) -> bool:
    """A worker's stats say it holds no request and no block (cached prefixes are free)."""
    return not (stats["num_running"] or stats["num_waiting"] or stats["num_swapped"] or stats["num_blocks_in_use"])


def drain_actor(handle, timeout_s: float, poll_s: float) -> bool:
    """Tell a worker to drain and wait up to ``timeout_s`` for it to hold nothing;
    whether it did (a dead or hung worker did not)."""
    t0 = time.monotonic()
    try:
        ray.get(handle.drain.remote(), timeout=PING_TIMEOUT_S)
        while True:  # looked at once at least, however short the deadline
            if is_idle(ray.get(handle.stats.remote(), timeout=PING_TIMEOUT_S)):
                return True
            if time.monotonic() - t0 >= timeout_s:
                return False
            time.sleep(poll_s)
    except (RayActorError, GetTimeoutError):
        return False


def forget_metrics(pid: int | None) -> None:
    """Drop a gone worker's live gauges from this node's metrics folder."""
    if pid is not None and os.environ.get(METRICS_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def unanswered(refs: list[WorkerRef]) -> list[bool]:
    """Ping the workers at once: for each, whether it is dead or silent past ``PING_TIMEOUT_S``."""
    pings = [ref.handle.ready.remote() for ref in refs]
    answered, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_TIMEOUT_S) if pings else ([], [])
    silent = []
    for ping in pings:
        try:
            if ping not in answered:
                raise GetTimeoutError()
            ray.get(ping)
            silent.append(False)
        except (RayActorError, GetTimeoutError):
            silent.append(True)
    return silent


def tell_sender_gone(readers: list[WorkerRef], worker_id: str) -> None:
    """Tell each decode worker in ``readers`` that prefill worker ``worker_id`` is killed, so
    that it releases the blocks a read of it kept out of use (``sender_gone``)."""
    for ref in readers:
        try:
            ref.handle.sender_gone.remote(worker_id)
        except Exception:  # a dead one releases nothing: the health thread replaces it
            pass


# The engine stats ``tandem status`` shows beside a worker's load: its host KV tier and LoRA adapters.
CACHE_STATS = ("prefix_cache_queries", "prefix_cache_hits", "host_cache_blocks", "host_cache_blocks_used",
               "host_cache_hits", "lora_resident_adapters", "lora_loads", "lora_evictions")


def worker_status(listed: list[tuple[str, WorkerRef, dict]], starting: list[tuple[str, str]]) -> dict[str, list[dict]]:
    """``TandemCluster.status`` from the workers it lists ((role, ref, where it runs)) and the
    replacements starting ((role, id)): the starting ones first, then each listed one with
    its load as a dict and its ``CACHE_STATS`` as ``cache`` (None for both: no answer
    within ``PING_TIMEOUT_S``)."""
    calls = [(role, ref, where, ref.handle.load.remote(), ref.handle.stats.remote()) for role, ref, where in listed]
    out: dict[str, list[dict]] = {}
    for role, worker_id in starting:
        out.setdefault(role, []).append(
            {"worker_id": worker_id, "draining": False, "starting": True, "load": None, "cache": None})
    for role, ref, where, load, stats in calls:
        try:
            answer, engine = ray.get([load, stats], timeout=PING_TIMEOUT_S)
            answer = dataclasses.asdict(answer)
            cache = {name: engine[name] for name in CACHE_STATS if name in engine}
        except (RayActorError, GetTimeoutError):
            answer = cache = None
        out.setdefault(role, []).append(
            {"worker_id": ref.worker_id, "draining": ref.draining, **where, "load": answer, "cache": cache})
    return out


def pool_loads(refs: list[WorkerRef], starting: list[str], colocated: bool) -> dict[str, list[tuple]]:
    """``TandemCluster.pool_state`` from the listed workers not draining and the ids of the
    replacements starting: per role (colocated workers count as decode), (id, engine stats,
    load) of each, None for both where a worker is starting or does not answer within
    ``PING_TIMEOUT_S``."""
    calls = [(w, w.handle.stats.remote(), w.handle.load.remote()) for w in refs]
    state: dict[str, list] = {"decode": []} if colocated else {"prefill": [], "decode": []}
    for worker_id in starting:
        state["prefill" if worker_id.startswith("prefill") else "decode"].append((worker_id, None, None))
    for w, stats, load in calls:
        try:
            answer = ray.get([stats, load], timeout=PING_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            answer = (None, None)
        state["prefill" if w.worker_id.startswith("prefill") else "decode"].append((w.worker_id, *answer))
    return state
