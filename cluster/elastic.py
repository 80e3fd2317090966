"""The pools' control loop: observe each role, ask the policy, carry out its decisions.

Every ``autoscaling.interval_s`` the cluster controller's loop reads each listed
worker's load and engine counters, turns them into one ``RoleObservation`` per role,
and hands those to ``cluster.autoscaler.Autoscaler``; a decision to add starts a worker
(``TandemCluster.add_worker``), one to remove drains the role's least busy worker
(``drain_worker``, ``autoscaling.drain_timeout_s``), and one to switch moves the other
role's least busy worker over warm (``switch_worker``: drained the same way, then reset
in place, its model kept). Each runs on a thread of its own
and counts as pending for its role until it is done, so the next rounds wait for it.

What stands for each role's latency is the later of what the routers' clients saw
(each router replica reports its p90 TTFT and ITL over its last ``latency_window_s``
with every worker-list refresh: ``router/latency.py``) and what the workers show over
the last interval, which sees trouble coming before clients do. The clients' TTFT counts
against the prefill pool only while prompts wait there: with its queue empty, a long
TTFT comes from elsewhere (decode workers without room), and the pool may be idle.

- prefill: the time its queue takes to clear, at the rate it prefilled: queued prompt
  tokens per worker over prompt tokens prefilled per second a worker;
- decode: the mean model-runner time of a step, which every running request waits for
  each token (the fullest worker's KV use and requests waiting for blocks beside it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from cluster.autoscaler import Autoscaler, AutoscalingConfig, Decision, RoleObservation

log = logging.getLogger(__name__)


class PoolScaler:
    """``cluster``: a ``TandemCluster`` (or anything with its ``pool_state``,
    ``add_worker``, ``drain_worker`` and ``switch_worker``); ``metrics``: an ``engine.wire.metrics.PoolMetrics``."""

    def __init__(self, cluster, config: AutoscalingConfig, metrics=None,
                 clock: Callable[[], float] = time.monotonic, latency: Callable[[], object] | None = None) -> None:
        """``latency``: what the routers' clients saw lately (a ``router.latency.LatencyReport``,
        or None), held against the SLO beside the workers' own estimates."""
        self.latency = latency
        self.cluster = cluster
        self.config = config
        self.policy = Autoscaler(config)
        self.metrics = metrics
        self.clock = clock
        self.decisions: deque[tuple[float, Decision]] = deque(maxlen=32)  # the latest, for status
        self._pending = {"prefill": 0, "decode": 0}  # changes under way that touch each role
        self._arriving = {"prefill": 0, "decode": 0}  # workers on their way into each role
        self._before: dict[str, tuple[float, dict]] = {}  # worker id -> (time, counters) last round
        self._state: dict[str, list] = {}  # the pools as the last round saw them
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.last_round: dict | None = None  # when the latest round ran, how long it took, what it saw

    # -- observing ---------------------------------------------------------------

    def observe(self, now: float) -> dict[str, RoleObservation]:
        """Each role's observation from the workers' state now and at the last round."""
        # The changes under way first, then the pools: a change that ends in between is
        # seen as pending with its result listed (a round without a decision), never as
        # not pending with its worker missing (which added that worker a second time).
        with self._lock:
            pending = dict(self._pending)
        state = self._state = self.cluster.pool_state()  # role -> [(id, stats, load)]: listed, not draining
        before, self._before = self._before, {}
        clients = self.latency() if self.latency is not None else None
        seen = {}
        for role, workers in state.items():
            queued = kv = 0.0
            rates, step_s = [], []
            for wid, stats, load in workers:
                if stats is None:  # no answer in time: counted in the pool, not in its load
                    continue
                now_counts = {"prompt": stats["prompt_tokens"], "steps": stats["num_steps"],
                              "forward": stats["forward_s"], "queued": getattr(load, "queued_prefill_tokens", 0)}
                self._before[wid] = (now, now_counts)
                if role == "prefill":
                    queued += load.queued_prefill_tokens
                else:
                    queued += load.waiting
                    kv = max(kv, 1 - load.free_blocks / max(1, load.total_blocks))
                if wid not in before:
                    continue  # rates need a round before
                then, counts = before[wid]
                if role == "prefill" and now > then:  # prompt tokens taken in, less what still waits
                    done = now_counts["prompt"] - counts["prompt"] - (now_counts["queued"] - counts["queued"])
                    rates.append(max(0.0, done) / (now - then))
                elif role != "prefill" and now_counts["steps"] > counts["steps"]:
                    step_s.append((now_counts["forward"] - counts["forward"]) / (now_counts["steps"] - counts["steps"]))
            n = max(1, sum(stats is not None for _, stats, _ in workers))  # those whose queues are summed
            latency = None
            if role == "prefill" and queued and rates:  # the first round has no rate yet
                rate = sum(rates) / len(rates)
                latency = 1e3 * (queued / n) / rate if rate > 0 else float("inf")  # queued, and none prefilled
            elif role != "prefill" and step_s:
                latency = 1e3 * max(step_s)
            seen_by_clients = None if clients is None else (clients.ttft_ms if role == "prefill" else clients.itl_ms)
            if role == "prefill" and not queued:
                # Nothing waits to be prefilled: a long TTFT comes from elsewhere (a decode
                # pool without room, say), which another worker here would not shorten.
                seen_by_clients = None
            if seen_by_clients is not None:  # the later of the two: either over the SLO presses the role
                latency = seen_by_clients if latency is None else max(latency, seen_by_clients)
            per_worker = queued / n if role == "prefill" else queued
            seen[role] = RoleObservation(len(workers), pending[role], latency, per_worker, kv)
        return seen

    # -- deciding and acting -----------------------------------------------------

    def step(self, now: float | None = None) -> list[Decision]:
        """One round: observe, decide, start what was decided."""
        now = self.clock() if now is None else now
        seen = self.observe(now)
        decisions = self.policy.decide(seen, now)
        self.last_round = {"at": now, "took_s": round(self.clock() - now, 3),
                           "seen": {role: dataclasses.asdict(o) for role, o in seen.items()}}
        for d in decisions:
            log.info("autoscaling: %s %d %s worker(s): %s", d.action, d.count, d.role, d.reason)
            self.decisions.append((now, d))
            self._act(d)
        if self.metrics is not None:
            self.metrics.on_pools({r: o.workers for r, o in seen.items()}, self.targets(seen, decisions))
        return decisions

    def targets(self, seen: dict[str, RoleObservation], decisions: list[Decision]) -> dict[str, int]:
        """The workers each role is heading for: those listed and not draining, plus those
        on their way in (started, or switching over), less those this round takes out
        (draining ones are not listed from the next round on)."""
        with self._lock:
            target = {r: seen[r].workers + self._arriving[r] for r in seen}
        for d in decisions:
            leaving = d.role if d.action == "remove" else ("decode" if d.role == "prefill" else "prefill")
            if d.action != "add" and leaving in target:
                target[leaving] -= 1
        return target

    def _least_busy(self, role: str) -> str:
        """The ``role`` worker with the least work in hand, as this round saw it (one that
        did not answer is left alone)."""
        def work(load) -> int:
            if role == "prefill":
                return load.queued_prefill_tokens + load.running_chunks
            return load.running + load.waiting

        answering = [w for w in self._state[role] if w[2] is not None]
        return min(answering, key=lambda w: work(w[2]))[0]

    def _act(self, d: Decision) -> None:
        timeout_s = self.config.drain_timeout_s
        if d.action == "add":  # each worker starts on a thread of its own
            for _ in range(d.count):
                self._background((d.role,), "adding", lambda: self.cluster.add_worker(d.role), arriving=d.role)
        elif d.action == "remove":
            victim = self._least_busy(d.role)
            self._background((d.role,), "removing", lambda: self.cluster.drain_worker(victim, timeout_s))
        elif d.action == "switch":  # the other role's least busy worker becomes one of d.role's
            other = "decode" if d.role == "prefill" else "prefill"
            victim = self._least_busy(other)
            self._background((d.role, other), "switching",
                             lambda: self.cluster.switch_worker(victim, d.role, timeout_s), arriving=d.role)
        else:
            raise ValueError(f"cannot carry out {d}")
        if self.metrics is not None:
            self.metrics.on_decision(d.role, "down" if d.action == "remove" else "up", d.cause)
            if d.action == "switch":  # (the switch itself is counted by the cluster once done)
                self.metrics.on_decision(other, "down", "switch")

    def _background(self, roles: tuple[str, ...], doing: str, fn: Callable[[], object],
                    arriving: str | None = None) -> None:
        """Run ``fn`` on a thread of its own; each of ``roles`` counts it as pending until
        it ends (and ``arriving``'s target counts the worker it brings in)."""
        with self._lock:
            for role in roles:
                self._pending[role] += 1
            if arriving is not None:
                self._arriving[arriving] += 1

        def run() -> None:
            try:
                fn()
            except Exception:  # the next rounds see the pools as they are and decide again
                log.exception("autoscaling: %s a %s worker failed", doing, roles[0])
            finally:
                with self._lock:
                    for role in roles:
                        self._pending[role] -= 1
                    if arriving is not None:
                        self._arriving[arriving] -= 1

        thread = threading.Thread(target=run, name=f"tandem-scale-{roles[0]}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def run(self, stop: threading.Event) -> None:
        """Rounds every ``interval_s`` until ``stop``; then waits for the changes under way."""
        while not stop.wait(self.config.interval_s):
            try:
                self.step()
            except Exception:  # a worker answering late, say: the next round tries again
                log.exception("autoscaling round failed")
        for thread in self._threads:
            thread.join()

    def status(self) -> dict:
        """Pending changes per role and the latest decisions (``ago_s``: how long ago), for
        ``tandem status``."""
        with self._lock:
            pending = dict(self._pending)
        now = self.clock()
        return {"pending": pending, "decisions": [
            {"at": at, "ago_s": round(now - at, 1), "action": d.action, "role": d.role, "count": d.count,
             "reason": d.reason}
            for at, d in self.decisions
        ], "last_round": self.last_round}
