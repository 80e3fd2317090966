"""A request's way through a live service that no step or transfer times.

Between the client and the workers' steps lie the HTTP ingress, the router, its calls to
both workers, the transfer's own calls and the first token's way back. None of it is a
step, so the cost model cannot time it; a live service measures it
(``bench.sim live-validate --live-profile``): each request's TTFT less the simulated one
on the live steps' costs. It grows with the load (on a shared host the service's CPU
competes with the workers' steps), and it has a tail, so it is kept as the delays seen,
grouped by how many requests were in flight as each was sent. A simulated request draws
one from its group.

The delays are residuals (measured less simulated), so their spread holds the
simulation's own misses too (a request queued behind another prefill live but not
simulated), which the simulated queueing already varies by: drawn as seen, they give the
calibration run a longer tail than it had. ``spread`` scales each draw's distance from its
group's median; ``bench.sim`` fits it to the calibration run's own TTFT percentiles.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

MIN_SAMPLES = 8  # delays a group holds at least


@dataclass(frozen=True)
class ServicePath:
    """Groups of measured delays (seconds, sorted): ``groups[i]`` is for requests sent while
    ``starts[i]`` or more others were in flight (up to the next group's start). No groups:
    no delay. ``spread``: how far a draw lies from its group's median, as a share of how far
    the delay seen does."""

    starts: tuple[int, ...] = ()
    groups: tuple[tuple[float, ...], ...] = ()
    spread: float = 1.0

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.groups) or not all(self.groups) or list(self.starts) != sorted(self.starts):
            raise ValueError("a service path needs a delay in each group, and groups in order of their starts")

    @classmethod
    def fixed(cls, seconds: float) -> ServicePath:
        """One delay for every request."""
        return cls((0,), ((seconds,),)) if seconds else cls()

    @classmethod
    def from_json(cls, doc: dict) -> ServicePath:
        """A profile's ``service_path``: ``{"groups": [{"in_flight": n, "delays_ms": [...]},
        ...], "spread": s}``."""
        groups = doc["groups"]
        return cls(tuple(int(g["in_flight"]) for g in groups),
                   tuple(tuple(sorted(v / 1e3 for v in g["delays_ms"])) for g in groups), float(doc["spread"]))

    def to_json(self) -> dict:
        return {"groups": [{"in_flight": n, "delays_ms": [round(v * 1e3, 3) for v in g]}
                           for n, g in zip(self.starts, self.groups, strict=True)],
                "spread": self.spread}

    @property
    def is_fixed(self) -> bool:
        """Whether every request takes the same delay (no draw, no count of those in flight)."""
        return len(self.groups) <= 1 and (not self.spread or all(len(g) == 1 for g in self.groups))

    def delay_s(self, in_flight: int, u: float) -> float:
        """A delay for a request sent with ``in_flight`` others in flight, drawn at ``u``
        (0 <= u < 1): its group's ``u``-quantile, ``spread`` of the way from the median."""
        if not self.groups:
            return 0.0
        group = self.groups[max(0, bisect_right(self.starts, in_flight) - 1)]
        median = _quantile(group, 0.5)
        return median + self.spread * (_quantile(group, u) - median)

    @classmethod
    def fit(cls, in_flight: Sequence[int], delays_s: Sequence[float], min_samples: int = MIN_SAMPLES) -> ServicePath:
        """Group measured delays (negative ones count as none) by the requests in flight
        as each was sent: from the fewest in flight up, each group takes counts until it
        holds ``min_samples`` delays; a last group with fewer joins the one before."""
        pairs = sorted(zip(in_flight, (max(0.0, d) for d in delays_s), strict=True))
        starts: list[int] = []
        groups: list[list[float]] = []
        for i, (n, d) in enumerate(pairs):
            if not groups or (len(groups[-1]) >= min_samples and n != pairs[i - 1][0]):
                starts.append(n)
                groups.append([])
            groups[-1].append(d)
        if len(groups) > 1 and len(groups[-1]) < min_samples:
            last = groups.pop()
            groups[-1] += last
            starts.pop()
        return cls(tuple(starts), tuple(tuple(sorted(g)) for g in groups))


NO_DELAY = ServicePath()


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-quantile of sorted values, linearly between them."""
    x = q * (len(ordered) - 1)
    i = math.floor(x)
    return ordered[i] if i + 1 >= len(ordered) else ordered[i] + (x - i) * (ordered[i + 1] - ordered[i])


def in_flight_at_send(sent_s: Sequence[float], ended_s: Sequence[float]) -> list[int]:
    """For each request, how many others were sent before it and had not yet ended."""
    ends = sorted(ended_s)
    starts = sorted(sent_s)
    return [bisect_left(starts, t) - bisect_right(ends, t) for t in sent_s]
