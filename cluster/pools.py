"""Starts and watches the worker pools of one deployment on a Ray cluster.

``TandemCluster.start()`` places each pool in a placement group (one bundle per
worker) and starts the actors, all within ``start_timeout_s``; a start that fails
removes what it placed. The routers run requests over the pools (``prefill_refs``,
``decode_refs``). A health thread pings every worker; a dead one is replaced in its
bundle, and the routers re-run or fail the requests that were on it. KV transfer channels are
per prefill-decode pair and made on first use, so a replacement needs nothing from
the other workers.

A worker at ``tensor_parallel_size`` N is N Ray actors: its own (rank 0) and a rank actor
per other rank (``cluster.rank_actors``), which it starts and owns. Each such worker has a
placement group of its own, N bundles on one node (``STRICT_PACK``), and lives and dies
whole: a rank that fails ends the worker, which is replaced like any dead one, in its
group, with new ranks.

Pools change size while serving: ``add_worker`` starts one more worker of a role (in a
bundle a removed worker left in its pool's group, else in a placement group of its
own) and lists it once it is ready; ``drain_worker`` takes one out without losing a
request. A draining worker is listed with ``draining`` set, so routers place nothing
new on it (and a decode worker refuses reservations itself, for a router whose list is
older); it finishes what it has up to a deadline, then it is killed and unlisted, and
whatever it still had follows the routers' re-run and migration rules. A worker's
lifecycle::

    add_worker ─▶ starting ─▶ listed ──drain_worker──▶ draining ──idle, or deadline──▶ removed
                                 └──dies──▶ replaced in its bundle (health thread): starting ─▶ listed

A replacement is listed once it is ready, never before: when its node is gone and no
other has room for its bundle, it stays starting (unlisted, waiting for room, which Ray
gives it when a node with room joins) while the pools serve on the workers left, and the
health thread goes on watching them; ``status`` shows it as starting.

Where the workers go (the pool a role joins, the placement groups and their bundles) is
``cluster.pool_placement``; the calls to the worker actors (starting one in its bundle,
draining, pinging, status and loads) are ``cluster.pool_actors``. This module keeps the
pools' state: each worker's slot, the groups, and the lock over them.

Works on a local Ray (``ray.init(num_cpus=...)`` by the caller) or an existing
cluster (``RAY_ADDRESS``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import remove_placement_group

from cluster.config import ClusterConfig
from cluster.pool_actors import (
    PING_TIMEOUT_S,
    drain_actor,
    forget_metrics,
    pool_loads,
    start_actor,
    tell_sender_gone,
    unanswered,
    worker_status,
)
from cluster.pool_placement import StartTimeout, place_pool, place_worker, pool_role
from engine.wire.messages import WorkerRef
from kv_transfer.config import TransferConfig

__all__ = ["PING_TIMEOUT_S", "READY_TIMEOUT_S", "StartTimeout", "TandemCluster"]

log = logging.getLogger(__name__)

# How long a replacement worker may take to load its model (its bundle is held already).
READY_TIMEOUT_S = 300.0


@dataclass
class _Slot:
    """One worker position in a pool: its bundle, and the actor now filling it."""

    role: str
    index: int
    pg: object = None  # the placement group holding its bundle
    bundle: int = 0  # the bundle's index in ``pg``
    ref: WorkerRef | None = None
    pid: int | None = None  # set once the actor filling it answered ``ready``: listed from then on
    node: str | None = None  # the host it runs on (a pod's name on Kubernetes), from the same answer
    starting: object = None  # a replacement's ``ready`` call, while it has not answered

    @property
    def listed(self) -> bool:
        return self.ref is not None and self.pid is not None

    def answered(self, info: dict) -> None:
        """The actor filling it answered ``ready`` (``WorkerBase.ready``): where it runs."""
        self.pid, self.node = info["pid"], info.get("node")


class TandemCluster:
    """One deployment's worker pools on Ray (the module docstring has a worker's lifecycle):
    ``start`` places and starts them, a health thread replaces dead workers, ``shutdown``
    removes it all. The cluster controller owns one; tests and benchmarks make their own."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._slots: list[_Slot] = []
        self._pgs: dict[str, object] = {}  # each pool's group, as placed at start
        self._own_pgs: list[object] = []  # groups of one bundle, for workers added past those
        self._free: dict[str, list[tuple[object, int]]] = {}  # role -> pool bundles removed workers left
        self._indices: dict[str, itertools.count] = {}  # role -> the next worker index
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._health: threading.Thread | None = None
        self.on_role_switch: Callable[[str, str], None] | None = None  # (from, to) after each switch

    # -- views -----------------------------------------------------------------

    def prefill_refs(self) -> list[WorkerRef]:
        return [s.ref for s in self._slots if s.role == "prefill" and s.listed]

    def decode_refs(self) -> list[WorkerRef]:
        return [s.ref for s in self._slots if s.role != "prefill" and s.listed]

    def workers(self) -> list[WorkerRef]:
        return [s.ref for s in self._slots if s.listed]

    def starting(self) -> list[str]:
        """The ids of the replacements not ready yet (unlisted: waiting for room, or loading)."""
        with self._lock:
            return [s.ref.worker_id for s in self._slots if s.ref is not None and not s.listed]

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> TandemCluster:
        """Place the pools, start their workers and wait until each is ready, all within
        ``config.start_timeout_s`` (a ``StartTimeout`` past it). A start that fails, on
        its deadline or otherwise, kills the workers it started and removes its placement
        groups before it raises: nothing it reserved holds resources a later start needs."""
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        try:
            self._place_pools(deadline)
            self._start_workers(deadline)
        except BaseException:
            self._release()
            raise
        if cfg.restart_workers:
            self._health = threading.Thread(target=self._watch, name="tandem-health", daemon=True)
            self._health.start()
        return self

    def _place_pools(self, deadline: float) -> None:
        """One placement group per pool, one bundle per worker; above one rank, one group per
        worker instead (``pool_placement.place_pool``). Each is kept in ``_pgs`` or
        ``_own_pgs`` as soon as it exists, so that a failure while waiting for it removes it."""
        cfg = self.config
        roles = ["decode" if not cfg.colocated else "colocated"]
        if not cfg.colocated:
            roles.insert(0, "prefill")
        for role in roles:
            count = cfg.prefill_workers if role == "prefill" else cfg.decode_workers
            placed = place_pool(cfg, role, count, deadline, self._pgs, self._own_pgs)
            self._slots.extend(_Slot(role, i, pg, bundle) for i, (pg, bundle) in enumerate(placed))
            self._indices[role] = itertools.count(count)

    def _start_workers(self, deadline: float) -> None:
        for slot in self._slots:
            slot.ref = self._spawn(slot)
        try:
            infos = ray.get(
                [s.ref.handle.ready.remote() for s in self._slots], timeout=max(0.0, deadline - time.monotonic())
            )
        except GetTimeoutError:
            raise StartTimeout(
                f"{len(self._slots)} worker(s) placed but not ready (loading the model) within "
                f"start_timeout_s={self.config.start_timeout_s:g} s; they are killed and their placement "
                f"groups removed; the next start tries again"
            ) from None
        for slot, info in zip(self._slots, infos):
            slot.answered(info)

    def shutdown(self) -> None:
        self._stop.set()
        self._release()

    def _release(self) -> None:
        """Kill the workers and remove the placement groups, so they hold nothing (under
        the lock: the health thread replaces no worker meanwhile, nor after a shutdown)."""
        with self._lock:
            slots, pgs = list(self._slots), [*self._pgs.values(), *self._own_pgs]
            self._slots.clear()
            self._pgs.clear()
            self._own_pgs.clear()
            self._free.clear()
        for slot in slots:
            if slot.ref is not None:
                ray.kill(slot.ref.handle, no_restart=True)
                forget_metrics(slot.pid)
        for pg in pgs:
            remove_placement_group(pg)

    def _spawn(self, slot: _Slot) -> WorkerRef:
        """Start the actor for ``slot`` in its bundle (``pool_actors.start_actor``), under a
        name no earlier actor of this deployment had."""
        worker_id = f"{slot.role}-{slot.index}"
        name = f"{self.config.name}-{worker_id}-{next(self._names)}"
        return start_actor(self.config, slot.role, worker_id, name, slot.pg, slot.bundle)

    def set_transfer(self, transfer: TransferConfig) -> None:
        """New transfer settings for every worker, replacements included; the backend
        must stay the same (``WorkerBase.set_transfer``)."""
        if transfer.backend != self.config.transfer.backend:
            raise ValueError(f"the transfer backend of running workers is {self.config.transfer.backend}, "
                             f"not {transfer.backend}")
        with self._lock:
            self.config = dataclasses.replace(self.config, transfer=transfer)
            ray.get([w.handle.set_transfer.remote(transfer) for w in self.workers()])

    # -- elastic pools ---------------------------------------------------------

    def add_worker(self, role: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Start one more ``role`` worker; returns its id once it is ready and listed.
        Its bundle is one a removed worker left in the pool's group, else a group of its
        own (``TimeoutError`` when the cluster cannot place it within ``timeout_s``)."""
        role = pool_role(self.config, role)
        with self._lock:
            free = self._free.get(role)
            pg, bundle = free.pop() if free else (None, 0)
            index = next(self._indices.setdefault(role, itertools.count()))
        if pg is None:
            pg = place_worker(self.config, role, timeout_s)
            with self._lock:
                self._own_pgs.append(pg)
        slot = _Slot(role, index, pg, bundle)
        try:
            slot.ref = self._spawn(slot)
            slot.answered(ray.get(slot.ref.handle.ready.remote(), timeout=timeout_s))
            with self._lock:
                if self._stop.is_set():
                    raise RuntimeError("the pools are shutting down")
                self._slots.append(slot)
        except BaseException:
            if slot.ref is not None:
                ray.kill(slot.ref.handle, no_restart=True)
            self._give_back(slot)
            raise
        log.info("added %s worker %s", role, slot.ref.worker_id)
        return slot.ref.worker_id

    def drain_worker(self, worker_id: str, timeout_s: float = 60.0, poll_s: float = 0.1) -> dict:
        """Take worker ``worker_id`` out of its pool: listed as draining (nothing new is
        placed on it), it finishes its requests and hand-offs for up to ``timeout_s``,
        then it is killed and unlisted. Returns whether it went idle first
        (``drained``) and how long it took. A pool keeps at least one decode worker."""
        with self._lock:
            slot = next((s for s in self._slots if s.listed and s.ref.worker_id == worker_id), None)
            if slot is None:
                raise KeyError(f"no listed worker {worker_id!r}")
            if slot.role != "prefill" and sum(s.role == slot.role and s.listed for s in self._slots) == 1:
                raise ValueError(f"{worker_id} is the last {slot.role} worker")
            slot.ref = dataclasses.replace(slot.ref, draining=True)
            handle = slot.ref.handle
        t0 = time.monotonic()
        drained = drain_actor(handle, timeout_s, poll_s)
        with self._lock:
            self._slots.remove(slot)
        ray.kill(handle, no_restart=True)
        self._sender_gone(slot.role, worker_id)
        forget_metrics(slot.pid)
        self._give_back(slot)
        seconds = time.monotonic() - t0
        log.info("removed %s worker %s after %.1f s (%s)", slot.role, worker_id, seconds,
                 "drained" if drained else f"not idle within {timeout_s:g} s: what it had moves on")
        return {"worker_id": worker_id, "drained": drained, "seconds": seconds}

    def switch_worker(self, worker_id: str, role: str, timeout_s: float = 60.0, poll_s: float = 0.1) -> dict:
        """Move worker ``worker_id`` to the other pool, ``role``, without restarting it
        (``cluster.pool_worker``): listed as draining, it finishes what it has for up to
        ``timeout_s`` like a drained worker, then retires its role (what is left moves on
        by the re-run and migration rules), resets its engine and is listed in ``role``'s
        pool under a new id and epoch. One that cannot reset (blocks still pinned) or dies
        meanwhile is replaced by a new ``role`` worker in its bundle. Returns its new id,
        whether it drained in time, whether it switched in place, and how long it took."""
        role = pool_role(self.config, role)
        if (why := self.config.role_switch_problem()) is not None:
            raise ValueError(f"workers cannot switch roles here: {why}")
        with self._lock:
            slot = next((s for s in self._slots if s.listed and s.ref.worker_id == worker_id), None)
            if slot is None:
                raise KeyError(f"no listed worker {worker_id!r}")
            if slot.role == role or slot.ref.draining:
                raise ValueError(f"{worker_id} is {'draining' if slot.ref.draining else f'a {role} worker'} already")
            if slot.role == "decode" and sum(s.role == "decode" and s.listed for s in self._slots) == 1:
                raise ValueError(f"{worker_id} is the last decode worker")
            slot.ref = dataclasses.replace(slot.ref, draining=True)
            old, old_role = slot.ref, slot.role
            index = next(self._indices.setdefault(role, itertools.count()))
        t0 = time.monotonic()
        drained = drain_actor(old.handle, timeout_s, poll_s)
        new_id = f"{role}-{index}"
        try:
            # Retiring waits out the reads in flight of its blocks, up to the lease.
            info = ray.get(old.handle.switch_role.remote(role, new_id),
                           timeout=READY_TIMEOUT_S + self.config.transfer.lease_s)
            ref = WorkerRef(new_id, old.handle, incarnation=f"{old.incarnation}@{info['epoch']}", epoch=info["epoch"])
            in_place = True
        except (RayActorError, GetTimeoutError, RuntimeError) as e:
            log.warning("worker %s could not switch in place (%s); starting a new %s worker in its bundle",
                        worker_id, e, role)
            ray.kill(old.handle, no_restart=True)
            self._sender_gone(old_role, worker_id)
            forget_metrics(slot.pid)
            ref, in_place = None, False
        with self._lock:
            slot.role, slot.index = role, index
            if self._stop.is_set():
                return {"worker_id": new_id, "drained": drained, "in_place": in_place, "seconds": 0.0}
            if ref is not None:
                slot.ref = ref
            else:
                self._replace(slot)
        if ref is None:
            self._await_replacements(READY_TIMEOUT_S, [slot])
        if self.on_role_switch is not None:
            self.on_role_switch(old_role, role)
        seconds = time.monotonic() - t0
        log.info("worker %s is now %s worker %s after %.1f s (%s, %s)", worker_id, role, new_id, seconds,
                 "drained" if drained else "not idle in time: what it had moved on",
                 "in place" if in_place else "restarted")
        return {"worker_id": new_id, "drained": drained, "in_place": in_place, "seconds": seconds}

    def status(self) -> dict[str, list[dict]]:
        """Every worker by role ("prefill", "decode" or "colocated"), draining ones too, with
        its process id, host and load as a dict (None: no answer within ``PING_TIMEOUT_S``);
        replacements not ready yet come first, marked ``starting``."""
        with self._lock:
            slots = [(s.role, s.ref, {"pid": s.pid, "node": s.node}) for s in self._slots if s.listed]
            starting = [(s.role, s.ref.worker_id) for s in self._slots if s.ref is not None and not s.listed]
        return worker_status(slots, starting)

    def pool_state(self) -> dict[str, list[tuple[str, dict | None, object]]]:
        """Per role ("prefill", "decode"; colocated workers count as decode), each listed
        worker that is not draining: (its id, its engine stats, its load). A worker that
        does not answer within ``PING_TIMEOUT_S`` (busy, or dying: the health thread sees
        to it), or a replacement still starting, is there with None for both: it still
        counts against the pool's size."""
        with self._lock:
            refs = [s.ref for s in self._slots if s.listed and not s.ref.draining]
            starting = [s.ref.worker_id for s in self._slots if s.ref is not None and not s.listed]
        return pool_loads(refs, starting, self.config.colocated)

    def _give_back(self, slot: _Slot) -> None:
        """A removed worker's bundle: kept for the next added worker when it is in the
        pool's group (a group cannot shrink), else its group is removed."""
        with self._lock:
            if slot.pg in self._own_pgs:
                self._own_pgs.remove(slot.pg)
                remove_placement_group(slot.pg)
            elif slot.pg is not None and not self._stop.is_set():
                self._free.setdefault(slot.role, []).append((slot.pg, slot.bundle))

    # -- health ----------------------------------------------------------------

    def check_health(self) -> list[str]:
        """Ping every listed worker at once; replace those dead or silent past
        ``PING_TIMEOUT_S`` in their bundles, and list the replacements that are ready. A
        replacement that is not (no node has room for its bundle yet, or it is loading)
        stays starting, unlisted, for a later round; one that died is replaced again.
        Returns the ids listed this round. Nothing is replaced once the pools are shutting
        down (their placement groups are going)."""
        with self._lock:
            live = [s for s in self._slots if s.listed and not s.ref.draining]  # draining: drain_worker's
        dead = [slot for slot, silent in zip(live, unanswered([s.ref for s in live])) if silent]
        with self._lock:
            if self._stop.is_set():
                return []
            for slot in [s for s in dead if s in self._slots and not s.ref.draining]:
                log.warning("worker %s is dead; starting a replacement", slot.ref.worker_id)
                try:
                    ray.kill(slot.ref.handle, no_restart=True)
                except Exception:  # already gone
                    pass
                self._sender_gone(slot.role, slot.ref.worker_id, locked=True)
                forget_metrics(slot.pid)
                self._replace(slot)
        return self._await_replacements(PING_TIMEOUT_S)

    def _sender_gone(self, role: str, worker_id: str, locked: bool = False) -> None:
        """A killed prefill worker's memory is gone, so no read of it can still land: every
        decode worker releases the blocks such a read kept out of use (``sender_gone``)."""
        if role != "prefill":
            return
        if not locked:
            with self._lock:
                return self._sender_gone(role, worker_id, locked=True)
        tell_sender_gone([s.ref for s in self._slots if s.listed and s.role != "prefill"], worker_id)

    def _replace(self, slot: _Slot) -> None:
        """A new actor in ``slot``'s bundle, unlisted until its ``ready`` answers (under the lock)."""
        slot.ref, slot.pid = self._spawn(slot), None
        slot.starting = slot.ref.handle.ready.remote()

    def _await_replacements(self, timeout_s: float, slots: list[_Slot] | None = None) -> list[str]:
        """Wait up to ``timeout_s`` for the replacements still starting (of ``slots``, when
        given); list those that answer ``ready`` and return their ids. One not ready by then stays starting (its
        bundle may be waiting for a node with room); one that died is replaced again (a
        replacement started just after its bundle's node was lost, before the GCS noticed,
        is cancelled once it does, and the bundle moves to a live node meanwhile)."""
        with self._lock:
            starting = [s for s in slots or self._slots if s.starting is not None]
        calls = [s.starting for s in starting]
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout_s) if calls else ([], [])
        ready = []
        with self._lock:
            for slot, call in zip(starting, calls):
                if call not in done or slot.starting is not call or self._stop.is_set():
                    continue  # still waiting (or changed meanwhile, or shutting down)
                try:
                    slot.answered(ray.get(call))
                except RayActorError as e:
                    log.warning("the replacement for worker %s died before it was ready (%s); starting "
                                "another", slot.ref.worker_id, type(e).__name__)
                    self._replace(slot)
                    continue
                slot.starting = None
                ready.append(slot.ref.worker_id)
                log.info("replacement %s worker %s is ready and listed", slot.role, slot.ref.worker_id)
        return ready

    def _watch(self) -> None:
        while not self._stop.wait(self.config.health_check_s):
            try:
                self.check_health()
            except Exception:  # keep watching; the next round retries
                if not self._stop.is_set():  # a shutdown kills what a round was waiting for
                    log.exception("health check failed")

    # -- introspection ---------------------------------------------------------

    def stats(self) -> dict[str, dict]:
        refs = self.workers()
        return dict(zip((w.worker_id for w in refs), ray.get([w.handle.stats.remote() for w in refs])))

    def blocks_in_use(self) -> dict[str, int]:
        return {wid: s["num_blocks_in_use"] for wid, s in self.stats().items()}
