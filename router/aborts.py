"""A bound on the Aborts a router replica passes to every worker.

A gRPC Abort names a request by the client's id. A request this replica runs is aborted
here (its stream ends; its attempts are aborted on the workers). Any other id may name a
request another replica runs, and the workers are the only ones who can tell: so the
replica asks every worker (``Dispatcher.abort``), a call on each of N workers and a scan
of each one's requests on its step thread. Unbounded, a client's Aborts of made-up ids
would each cost N worker calls. ``AbortBudget`` is a token bucket over those pass-ons,
one per replica: ``AbortConfig.burst`` at once, then ``per_s`` a second; past it the
Abort is refused (RESOURCE_EXHAUSTED, with the seconds until the next is let through).

Pure: the time is passed in as ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AbortConfig:
    """How many Aborts of requests it does not run a replica passes to every worker:
    ``burst`` at once, then ``per_s`` a second; checked on creation."""

    per_s: float = 20.0
    burst: int = 40

    def __post_init__(self) -> None:
        if not self.per_s > 0:
            raise ValueError(f"aborts.per_s must be > 0, got {self.per_s}")
        if self.burst < 1:
            raise ValueError(f"aborts.burst must be >= 1, got {self.burst}")


class AbortBudget:
    """A token bucket of pass-ons: full (``burst``) at first, refilled at ``per_s``."""

    def __init__(self, config: AbortConfig) -> None:
        self.config = config
        self._tokens = float(config.burst)
        self._at: float | None = None  # when _tokens was last brought up to date

    def try_take(self, now: float) -> int | None:
        """Take one pass-on: None when taken, else the whole seconds until one is free."""
        cfg = self.config
        if self._at is not None:
            self._tokens = min(float(cfg.burst), self._tokens + (now - self._at) * cfg.per_s)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return None
        return max(1, math.ceil((1 - self._tokens) / cfg.per_s))
