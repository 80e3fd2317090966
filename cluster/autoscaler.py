"""How many workers each pool should have: the policy of the pools' control loop.

Pure (no Ray, no clock of its own: ``now`` comes in), so it is tested as a function of
what it observes. Every ``interval_s`` the cluster controller observes each role
(``RoleObservation``: its workers, how late it is against the SLO, how full it is) and
carries out what ``Autoscaler.decide`` returns: add a worker, drain one out, or switch a
warm worker from one role to the other.

The rules, per role (prefill answers for TTFT, decode for ITL):

- **pressed**: its latency is over its SLO, or work waits that it has no room for
  (prefill: queued prompt tokens past ``max_queued_tokens`` a worker; decode: requests
  waiting for blocks while its KV is nearly full);
- **idle**: its latency is under ``low_water`` of its SLO (or nothing ran), nothing
  waits, and its KV use is under ``low_water``. Between the two is the hysteresis band:
  nothing changes there.

A pressed role below ``max_workers`` gets more workers: one taken from the other role
when that one has been idle for ``scale_down_delay_s`` and is above its
``min_workers`` (and switching is allowed), else ``scale_up_share`` of its workers (at
least one, at most up to its maximum) started anew; at its maximum it can only take one
from an idle other role. Adding a share rather than one at a time is what lets a large
pool follow a ramp: a worker on a GPU takes a minute or more to start, and the next
change waits for it (``tandem plan --low-rate`` showed 8 colocated H100s adding one a
minute miss the SLO on a 5-minute ramp from 30 to 120 req/s). A role idle for ``scale_down_delay_s`` and
above its minimum loses one worker. One change per role at a time: nothing is decided
for a role while a change of it is under way (``pending``), and an idle stretch starts
again after each change, so the pools step, never flap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PoolBounds:
    """How small and how large the autoscaler may make one pool (``autoscaling.prefill``
    or ``autoscaling.decode``)."""

    min_workers: int = 1
    max_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"pool bounds need 0 <= min_workers <= max_workers, got {self}")


@dataclass(frozen=True)
class SLO:
    """The latency targets the autoscaler holds the roles to: TTFT for prefill, ITL for decode."""

    ttft_ms: float = 1000.0
    itl_ms: float = 50.0

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            raise ValueError(f"SLO targets must be > 0 ms, got {self}")


@dataclass(frozen=True)
class AutoscalingConfig:
    """The topology's ``autoscaling:`` section."""

    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    slo: SLO = field(default_factory=SLO)
    interval_s: float = 5.0  # how often the controller observes and decides
    scale_down_delay_s: float = 30.0  # how long a role stays idle before it gives a worker up
    scale_up_share: float = 0.5  # a pressed role starts this share of its workers at once (at least 1; 0: one)
    allow_role_switch: bool = False  # move a warm worker between roles instead of stopping and starting
    low_water: float = 0.5  # idle below this share of the SLO (and of the KV)
    max_queued_tokens: int = 8192  # prefill: queued prompt tokens per worker that count as pressure
    kv_full: float = 0.9  # decode: KV use past which waiting requests count as pressure
    drain_timeout_s: float = 60.0  # a drained worker's time to finish before what it has moves

    def __post_init__(self) -> None:
        for name in ("interval_s", "scale_down_delay_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscaling.{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.scale_up_share <= 4:
            raise ValueError(f"autoscaling.scale_up_share must be in [0, 4], got {self.scale_up_share}")
        if not 0 < self.low_water < 1:
            raise ValueError(f"autoscaling.low_water must be in (0, 1), got {self.low_water}")
        if not 0 < self.kv_full <= 1:
            raise ValueError(f"autoscaling.kv_full must be in (0, 1], got {self.kv_full}")
        for role in ROLES:  # an empty pool shows no load to scale it back up by
            if self.bounds(role).min_workers < 1:
                raise ValueError(f"autoscaling.{role}.min_workers must be >= 1, got {self.bounds(role).min_workers}")

    def bounds(self, role: str) -> PoolBounds:
        return self.prefill if role == "prefill" else self.decode

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AutoscalingConfig:
        d = dict(d)
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown autoscaling settings: {sorted(unknown)}")
        for role in ROLES:
            if isinstance(d.get(role), dict):
                d[role] = PoolBounds(**d[role])
        if isinstance(d.get("slo"), dict):
            d["slo"] = SLO(**d["slo"])
        return cls(**d)


@dataclass(frozen=True)
class RoleObservation:
    """One role as the controller saw it over the last interval."""

    workers: int  # listed and not draining
    pending: int = 0  # changes of this role under way (a worker starting, draining or switching)
    latency_ms: float | None = None  # prefill: TTFT, decode: ITL (a high percentile); None: nothing ran
    queued: float = 0.0  # prefill: queued prompt tokens per worker; decode: requests waiting for blocks
    kv_usage: float = 0.0  # decode: the fullest worker's share of KV blocks in use


@dataclass(frozen=True)
class Decision:
    """One change ``Autoscaler.decide`` asks of the controller: add, remove or switch a worker of a
    role, with the reason in words and its cause for metrics."""

    action: str  # "add", "remove" or "switch" (a worker of the other role becomes ``role``)
    role: str  # the role that gains (add, switch) or loses (remove) a worker
    reason: str
    cause: str = ""  # for metrics: "slo" (latency), "queue" (work waiting without room) or "idle"
    count: int = 1  # workers to add (add only)


def decision_text(d: dict[str, Any]) -> str:
    """A decision as ``tandem status`` and ``tandem sim`` print it ("add 3 decode: why";
    the count only when over one)."""
    count = d.get("count", 1)
    return f"{d['action']}{f' {count}' if count > 1 else ''} {d['role']}: {d['reason']}"


class Autoscaler:
    """``decide`` once an interval; it keeps only when each role became idle."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self._idle_since: dict[str, float | None] = {role: None for role in ROLES}

    def _target(self, role: str) -> float:
        slo = self.config.slo
        return slo.ttft_ms if role == "prefill" else slo.itl_ms

    def pressed(self, role: str, seen: RoleObservation) -> tuple[str, str] | None:
        """Why ``role`` needs another worker (its cause, "slo" or "queue", and the
        reason in words), or None."""
        cfg, target = self.config, self._target(role)
        if seen.latency_ms is not None and seen.latency_ms > target:
            what = "TTFT" if role == "prefill" else "ITL"
            return "slo", f"{what} {seen.latency_ms:.0f} ms over the SLO's {target:g} ms"
        if role == "prefill" and seen.queued > cfg.max_queued_tokens:
            return "queue", (f"{seen.queued:.0f} prompt tokens queued a worker "
                             f"(max_queued_tokens {cfg.max_queued_tokens})")
        if role == "decode" and seen.queued > 0 and seen.kv_usage >= cfg.kv_full:
            return "queue", f"{seen.queued:.0f} requests wait with KV {seen.kv_usage:.0%} full"
        return None

    def idle(self, role: str, seen: RoleObservation) -> bool:
        low = self.config.low_water
        quiet = seen.latency_ms is None or seen.latency_ms < low * self._target(role)
        return quiet and seen.queued == 0 and seen.kv_usage < low

    def decide(self, seen: dict[str, RoleObservation], now: float) -> list[Decision]:
        """What to change now, given each role's observation (both roles' keys; a
        colocated deployment observes "decode" only)."""
        cfg = self.config
        roles = [r for r in ROLES if r in seen]
        for role in roles:  # how long each has been idle, reset by any change under way
            if seen[role].pending or not self.idle(role, seen[role]):
                self._idle_since[role] = None
            elif self._idle_since[role] is None:
                self._idle_since[role] = now

        def spare(role: str) -> bool:  # idle long enough to give a worker up
            since = self._idle_since.get(role)
            return (role in seen and not seen[role].pending and since is not None
                    and now - since >= cfg.scale_down_delay_s and seen[role].workers > cfg.bounds(role).min_workers)

        decisions: list[Decision] = []
        changed: set[str] = set()
        for role in roles:
            obs = seen[role]
            pressure = self.pressed(role, obs)
            if pressure is None or obs.pending or role in changed:
                continue
            cause, why = pressure
            other = "decode" if role == "prefill" else "prefill"
            if cfg.allow_role_switch and spare(other) and other not in changed:
                reason = f"{why}; {other} idle for {cfg.scale_down_delay_s:g} s"
                decisions.append(Decision("switch", role, reason, cause))
                changed |= {role, other}
            elif obs.workers < cfg.bounds(role).max_workers:
                room = cfg.bounds(role).max_workers - obs.workers
                count = min(room, max(1, math.ceil(obs.workers * cfg.scale_up_share)))
                decisions.append(Decision("add", role, why, cause, count))
                changed.add(role)
        for role in roles:
            since = self._idle_since[role]
            if role not in changed and since is not None and spare(role):
                decisions.append(Decision("remove", role, f"idle for {now - since:.0f} s", "idle"))
                changed.add(role)
        for role in changed:
            self._idle_since[role] = None
        return decisions
