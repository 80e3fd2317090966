"""What clients saw lately, for the pools' control loop: each router replica keeps its
recent time-to-first-token and inter-token latency samples and reports their percentile
to the cluster controller with each worker-list refresh (``RouterCore._refresh``).

Pure: ``now`` comes in, so it is tested as a function of its samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

PERCENTILE = 0.9  # the SLO is held at p90, as DistServe's attainment and llm-d's scaling


@dataclass(frozen=True)
class LatencyReport:
    """One router's latency over its window: the p90 TTFT and ITL in ms (None: no sample)
    and how many requests and tokens they come from."""

    ttft_ms: float | None
    itl_ms: float | None
    requests: int
    tokens: int


class LatencyWindow:
    """The samples of the last ``span_s`` seconds (at most ``max_samples`` of each kind)."""

    def __init__(self, span_s: float = 30.0, max_samples: int = 4096) -> None:
        self.span_s = span_s
        self.max_samples = max_samples
        self._ttft: deque[tuple[float, float, int]] = deque(maxlen=max_samples)  # (when, seconds, weight 1)
        self._itl: deque[tuple[float, float, int]] = deque(maxlen=max_samples)  # (when, seconds a token, tokens)

    def first_token(self, seconds: float, now: float) -> None:
        self._ttft.append((now, seconds, 1))

    def tokens(self, num_tokens: int, seconds: float, now: float) -> None:
        """``num_tokens`` arrived together ``seconds`` after the previous ones: each waited
        ``seconds / num_tokens`` (as the ITL histogram counts them)."""
        if num_tokens > 0:
            self._itl.append((now, seconds / num_tokens, num_tokens))

    def report(self, now: float) -> LatencyReport:
        for samples in (self._ttft, self._itl):
            while samples and now - samples[0][0] > self.span_s:
                samples.popleft()
        ttft, itl = _percentile(self._ttft), _percentile(self._itl)
        return LatencyReport(
            ttft_ms=None if ttft is None else 1e3 * ttft,
            itl_ms=None if itl is None else 1e3 * itl,
            requests=len(self._ttft),
            tokens=sum(n for _, _, n in self._itl),
        )


def _percentile(samples: Iterable[tuple[float, float, int]], q: float = PERCENTILE) -> float | None:
    """The weighted ``q`` quantile of (when, value, weight) samples (the smallest value
    with at least ``q`` of the weight at or below it)."""
    if not samples:
        return None
    ordered = sorted((value, weight) for _, value, weight in samples)
    total = sum(weight for _, weight in ordered)
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= q * total:
            return value
    return ordered[-1][0]


def merge(reports: list[LatencyReport]) -> LatencyReport | None:
    """Several routers' reports as one: the worst percentile of those that saw anything
    (each router's clients must meet the SLO), the counts summed; None without any."""
    seen = [r for r in reports if r.requests or r.tokens]
    if not seen:
        return None
    ttfts = [r.ttft_ms for r in seen if r.ttft_ms is not None]
    itls = [r.itl_ms for r in seen if r.itl_ms is not None]
    return LatencyReport(max(ttfts, default=None), max(itls, default=None),
                         sum(r.requests for r in seen), sum(r.tokens for r in seen))
