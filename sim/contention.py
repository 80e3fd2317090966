"""How much longer a step takes on a host whose cores the workers and the service share.

A local cluster on a CPU runs every worker, the router, the proxy and Ray on the same
cores. A step begun while other workers are mid-step takes longer, and longer again the
more requests are in flight (their tokens stream through the router and the proxy on
those cores). Timed inside the live workers (``bench.sim live-validate --live-profile``),
each step's slowdown over the fitted cost of the step alone is kept by the step's role
(a long prefill step shares its time with many decode steps, a decode step with a part
of one prefill), by how many other workers were mid-step as it began, and by the
requests in flight then.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

ANY_ROLE = ""  # steps whose role the table does not say (one table for every role)
MIN_STEPS = 5  # steps of one kind, at least, to take their slowdown as its own
MIN_FACTOR = 0.5  # a slope never makes a step less than half its time alone


@dataclass(frozen=True)
class RoleContention:
    """One role's steps: ``factors[k]`` is the mean slowdown of those begun beside k other
    workers mid-step (the last for more), at ``in_flight[k]`` requests in flight (their
    mean); with n requests in flight it moves by ``per_request * (n - in_flight[k])``."""

    factors: tuple[float, ...]
    in_flight: tuple[float, ...]
    per_request: float = 0.0

    def factor(self, others_busy: int, in_flight: int) -> float:
        k = min(others_busy, len(self.factors) - 1)
        return max(MIN_FACTOR, self.factors[k] + self.per_request * (in_flight - self.in_flight[k]))


@dataclass(frozen=True)
class Contention:
    """By role (``ANY_ROLE`` for all), how a step's time is multiplied on a shared host.
    Empty: the workers do not share (a device each)."""

    by_role: dict[str, RoleContention] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_role)

    def factor(self, role: str, others_busy: int, in_flight: int) -> float:
        table = self.by_role.get(role) or self.by_role.get(ANY_ROLE)
        return table.factor(others_busy, in_flight) if table is not None else 1.0

    @classmethod
    def fit(cls, steps: Iterable[tuple[str, int, int, float]]) -> Contention:
        """From ``(role, others_busy, in_flight, slowdown)`` of timed steps: per role, the
        mean slowdown (each cut to 0.25-4x) and in-flight count for each number of others
        mid-step (a count no step had, or too few, takes the one below; none begun alone
        counts 1), and the slope of the slowdown in the requests in flight, within those
        counts. Means, not medians: a simulated step stands for the mean of the live ones
        like it (TPOT and E2E are means)."""
        seen: dict[str, dict[int, list[tuple[int, float]]]] = {}
        for role, k, n, slowdown in steps:
            seen.setdefault(role, {}).setdefault(k, []).append((n, min(max(slowdown, 0.25), 4.0)))
        return cls({role: _fit_role(by_k) for role, by_k in seen.items()})


NO_CONTENTION = Contention()


def _fit_role(by_k: dict[int, list[tuple[int, float]]]) -> RoleContention:
    factors: list[float] = []
    in_flight: list[float] = []
    for k in range(max(by_k) + 1):
        rows = by_k.get(k, [])
        if len(rows) >= MIN_STEPS or not factors:
            factors.append(_mean([s for _, s in rows]) if rows else 1.0)
            in_flight.append(_mean([n for n, _ in rows]) if rows else 0.0)
        else:
            factors.append(factors[-1])
            in_flight.append(in_flight[-1])
    # The slope of the slowdown in n, within each count of others mid-step (least squares).
    num = den = 0.0
    for k, rows in by_k.items():
        if len(rows) >= MIN_STEPS:
            num += sum((n - in_flight[k]) * (s - factors[k]) for n, s in rows)
            den += sum((n - in_flight[k]) ** 2 for n, _ in rows)
    return RoleContention(tuple(factors), tuple(in_flight), num / den if den else 0.0)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
