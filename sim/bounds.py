"""The planner's elastic step: scaling bounds for pools that follow a load that swings.

For traffic between a low rate and the planned peak (a ``RateProfile``, by default
``RateProfile.day``: low, a ramp up, the peak, a ramp down, low), the pools the planner
sized for the peak are the ceiling (``max_workers``); the search is over the floor
(``min_workers``: where the pools start, and what they shrink back to when idle) and,
when asked, over how many workers a pressed pool starts at once (``scale_up_share``).

Each floor is a share of the ceiling, per pool (at least one worker): the low rate's
share of what the ceiling sustains, times each of ``FLOOR_FACTORS``. Each floor (with
each scale-up share) is simulated whole over the profile with the controller's own
autoscaling policy (``sim/scaling.py``: a pressed pool starts ``scale_up_share`` of its
workers, an added worker serving ``worker_start_s`` after it was asked for), and the
bounds that hold the fewest device-seconds while ``attainment`` of all the profile's
requests meet the SLO are chosen. The baseline is the ceiling held fixed all day; when
nothing meets the SLO on fewer device-seconds than that, the pools stay fixed (min =
max), and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cluster.autoscaler import SLO, AutoscalingConfig, PoolBounds
from sim.cost import CostModel
from sim.report import SloTarget, summary
from sim.simulator import run
from sim.topology import SimTopology
from sim.workload import RateProfile, SimRequest

FLOOR_FACTORS = (1.0, 1.5, 2.0, 3.0)


@dataclass
class BoundsTrial:
    """One floor share, its topology (pools at the floor, with their bounds; the ceiling held
    fixed when ``autoscaling`` is None) and its simulation's summary over the profile."""

    share: float
    topology: SimTopology
    summary: dict

    def meets(self, slo: SloTarget) -> bool:
        return self.summary["slo_attainment"] >= slo.attainment

    @property
    def device_s(self) -> float:
        return self.summary["device_s"]

    def label(self) -> str:
        topo, a = self.topology, self.topology.autoscaling
        if a is None:
            return f"fixed {_pools(topo.prefill_workers, topo.decode_workers)}"
        prefill = None if topo.colocated else f"{a.prefill.min_workers}-{a.prefill.max_workers}"
        pools = _pools(prefill, f"{a.decode.min_workers}-{a.decode.max_workers}")
        return f"elastic {pools} scale-up {a.scale_up_share:g}"


def _pools(prefill, decode) -> str:
    return f"colocated {decode}" if prefill in (0, None) else f"{prefill}P+{decode}D"


@dataclass
class BoundsPlan:
    """The fixed baseline, every floor tried (lowest first) and the one chosen (the
    baseline when none met the SLO)."""

    fixed: BoundsTrial
    trials: list[BoundsTrial]
    chosen: BoundsTrial

    @property
    def saved(self) -> float:
        """The share of the baseline's device-seconds the chosen bounds do without."""
        return 1 - self.chosen.device_s / self.fixed.device_s if self.fixed.device_s > 0 else 0.0


def floor_shares(low_share: float, factors: tuple[float, ...] = FLOOR_FACTORS) -> list[float]:
    """The floors to try, as shares of the ceiling: ``low_share`` times each factor, below 1."""
    return sorted({round(min(low_share * k, 1.0), 6) for k in factors} - {1.0})


def elastic_topology(ceiling: SimTopology, share: float, scaling: AutoscalingConfig) -> SimTopology:
    """``ceiling``'s pools as the bounds' maxima, ``share`` of them (at least 1) as the minima,
    the pools starting at the minima."""
    def bounds(n: int) -> PoolBounds:
        return PoolBounds(min(n, max(1, math.ceil(n * share))), n)

    prefill = bounds(ceiling.prefill_workers) if not ceiling.colocated else PoolBounds(1, 1)
    decode = bounds(ceiling.decode_workers)
    config = replace(scaling, prefill=prefill, decode=decode)
    return ceiling.replace(prefill_workers=0 if ceiling.colocated else prefill.min_workers,
                           decode_workers=decode.min_workers, autoscaling=config)


def default_scaling(slo: SloTarget) -> AutoscalingConfig:
    """The controller's defaults, held to the plan's SLO."""
    return AutoscalingConfig(slo=SLO(ttft_ms=slo.ttft_ms, itl_ms=slo.step_ms))


def plan_bounds(ceiling: SimTopology, capacity: float, cost: CostModel, requests: list[SimRequest],
                profile: RateProfile, slo: SloTarget, scaling: AutoscalingConfig,
                factors: tuple[float, ...] = FLOOR_FACTORS, scale_up_shares: Sequence[float] = (),
                progress=None) -> BoundsPlan:
    """Search the floor of pools whose ceiling is ``ceiling`` (which sustains ``capacity``
    requests/s) for ``requests`` arriving over ``profile`` (module docstring), with each of
    ``scale_up_shares`` (by default only ``scaling``'s own)."""
    def simulate(share: float, topo: SimTopology) -> BoundsTrial:
        t = BoundsTrial(share, topo, summary(run(topo, cost, requests), slo))
        if progress is not None:
            progress(t)
        return t

    fixed = simulate(1.0, ceiling.replace(autoscaling=None))
    floors: dict[tuple[int, int], tuple[float, SimTopology]] = {}
    for share in floor_shares(profile.low / capacity if capacity > 0 else 1.0, factors):
        topo = elastic_topology(ceiling, share, scaling)
        floors.setdefault((topo.prefill_workers, topo.decode_workers), (share, topo))  # shares that round alike
    ups = scale_up_shares or (scaling.scale_up_share,)
    trials = [simulate(share, elastic_topology(ceiling, share, replace(scaling, scale_up_share=up)))
              for share, topo in floors.values() if topo.num_devices < ceiling.num_devices for up in ups]
    meeting = [t for t in trials if t.meets(slo) and t.device_s < fixed.device_s]
    return BoundsPlan(fixed, trials, min(meeting, key=lambda t: t.device_s) if meeting else fixed)
