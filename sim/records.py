"""A simulated run's data: each replayed request's ``Record`` and the run's ``SimResult``.

``sim/simulator.py`` fills them as it replays a workload (``sim/client_tokens.py`` keeps the
token times on each ``Record``); ``sim/report.py`` reads them in the serving benchmark's terms.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from cluster.autoscaler import Decision
from router.admission import Ticket
from sim.worker import SimWorker
from sim.workload import SimRequest


@dataclass(slots=True)
class Record:
    """One replayed request as the client sees it: token times on the simulated clock, the
    workers it went to, its admission ticket and how it ended."""

    index: int
    req: SimRequest
    ticket: Ticket | None = None
    decode: SimWorker | None = None
    prefill: SimWorker | None = None
    held_blocks: int = 0
    token_times: array = field(default_factory=lambda: array("d"))
    end_s: float | None = None
    error: str | None = None
    cached_tokens: int = 0
    deadline_s: float = math.inf


@dataclass
class SimResult:
    """A run's records and what the workers counted (preemptions, steps, queue samples), with
    the simulation's own CPU time."""

    records: list[Record]
    num_preemptions: int
    num_steps: int
    queue_samples: list[dict]
    sim_cpu_s: float
    num_devices_max: int
    scaling_decisions: list[tuple[float, Decision]]  # when, and what the autoscaler decided
    local_prefills: int = 0
    device_s: float = 0.0  # devices held over time, to the last request's end (starting ones too)
    end_s: float = 0.0  # simulated time at the last request's end
