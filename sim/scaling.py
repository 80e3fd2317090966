"""Autoscaling in the simulator: the controller's own observation and policy, carried out on
simulated workers.

Every ``interval_s`` of simulated time ``cluster.elastic.PoolScaler.observe`` reads the
simulated pools (``pool_state``: each listed worker's engine counters and load report,
as the live cluster gives them; runs of decode steps are cut first) and what clients
saw over the last 10 s (a ``router.latency.LatencyWindow`` given every token up to now,
``Simulator.latency_report``), and
``cluster.autoscaler.Autoscaler.decide`` says what to change; the simulator carries it
out instead of Ray:

- add: a new worker joins its pool ``worker_start_s`` later (starting, it counts as
  pending and as its devices, one a rank);
- remove: the role's least busy worker drains (takes no new requests) and leaves once
  it holds nothing;
- switch: the other role's least busy worker drains, then joins ``role`` with a fresh
  scheduler (an engine reset).

Changes under way count as ``pending`` for their roles, as the controller's threads do.
The drain timeout is not modelled: a draining worker finishes what it holds.
"""

from __future__ import annotations

from dataclasses import replace

from cluster.autoscaler import AutoscalingConfig, Decision
from cluster.elastic import PoolScaler
from sim.worker import SimWorker


class SimScaling:
    """The simulator's pools' control loop; ``tick`` is one round. Owned by a ``Simulator``."""

    def __init__(self, sim, config: AutoscalingConfig) -> None:
        self.sim = sim
        self.config = config
        self.scaler = PoolScaler(self, config, clock=lambda: sim.now, latency=sim.latency_report)
        self.pending = {"prefill": 0, "decode": 0}
        self.starting = 0
        self.decisions: list[tuple[float, Decision]] = []
        self._switch_to: dict[str, str] = {}  # draining worker id -> the role it joins

    def pool_state(self) -> dict[str, list]:
        """role -> [(worker id, engine counters, load report)] of listed, not draining workers."""
        roles = ("decode",) if self.sim.topology.colocated else ("prefill", "decode")
        return {
            role: [(w.worker_id, w.stats(), w.prefill_load() if role == "prefill" else w.decode_load(self.sim.now))
                   for w in self.sim.pools[role] if not w.draining]
            for role in roles
        }

    def tick(self, _=None) -> None:
        now = self.sim.now
        self.sim.cut_runs()  # what the controller reads is the state of now, runs or not
        seen = self.scaler.observe(now)
        seen = {role: replace(obs, pending=self.pending[role]) for role, obs in seen.items()}
        for d in self.scaler.policy.decide(seen, now):
            self.decisions.append((now, d))
            self._act(d)
        self.sim.at(now + self.config.interval_s, self.tick)

    def _least_busy(self, role: str) -> SimWorker | None:
        live = [w for w in self.sim.pools[role] if not w.draining]
        if not live:
            return None
        return min(live, key=lambda w: w.scheduler.num_unfinished + len(w.scheduler.held))

    def _act(self, d: Decision) -> None:
        if d.action == "add":
            self.pending[d.role] += d.count
            self.starting += d.count * self.sim.topology.tensor_parallel_size(d.role)  # devices
            for _ in range(d.count):
                self.sim.at(self.sim.now + self.sim.topology.worker_start_s, self._join, d.role)
            self.sim.note_devices()
            return
        leaving = d.role if d.action == "remove" else ("decode" if d.role == "prefill" else "prefill")
        victim = self._least_busy(leaving)
        if victim is None:
            return
        victim.draining = True
        self.pending[leaving] += 1
        if d.action == "switch":
            self.pending[d.role] += 1
            self._switch_to[victim.worker_id] = d.role
        self.check_drained(victim)

    def _join(self, role: str) -> None:
        self.starting -= self.sim.topology.tensor_parallel_size(role)
        self.pending[role] -= 1
        self.sim.add_worker(role)

    def check_drained(self, w: SimWorker) -> None:
        """A draining worker that holds nothing leaves its pool (a switching one joins its new role)."""
        if not w.draining or w.holds_work() or w not in self.sim.pools[w.role]:
            return
        self.sim.retire_worker(w)
        self.pending[w.role] -= 1
        target = self._switch_to.pop(w.worker_id, None)
        if target is not None:
            self.pending[target] -= 1
            self.sim.add_worker(target)
