"""The soak test's judgement, pure: which requests it cancels and when (``choose_cancel``),
the trend of a series over the second half of the load (``fit_trend``), and the verdict on
every process's memory and every worker's KV blocks (``judge``). ``bench.soak`` runs the
load and feeds it the samples."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

MB = 1 << 20
# Ray's own processes: recorded (a leak of Ray objects shows there) but not judged.
RAY_INTERNALS = ("raylet", "gcs_server")


@dataclass(frozen=True)
class CancelPoint:
    """Where a request is cancelled: after ``after_s`` seconds from sending, or after
    ``after_chunks`` token-carrying chunks of its stream (exactly one is set)."""

    after_s: float | None = None
    after_chunks: int | None = None


def choose_cancel(
    rng: random.Random, fraction: float, output_len: int, max_delay_s: float
) -> CancelPoint | None:
    """None (run to the end) or where to cancel; seeded by ``rng`` alone.

    Half the cancellations come after a delay uniform in [0, ``max_delay_s``), which
    reaches requests still queued, in prefill or in KV transfer (no chunk has arrived
    then: the response starts with the first token); the other half after 1 to
    ``output_len - 1`` chunks, mid-decode.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"cancel fraction must be in [0, 1], got {fraction}")
    if rng.random() >= fraction:
        return None
    if rng.random() < 0.5:
        return CancelPoint(after_s=rng.uniform(0.0, max_delay_s))
    return CancelPoint(after_chunks=rng.randint(1, max(1, output_len - 1)))


@dataclass(frozen=True)
class Trend:
    """A least-squares line through (t, value) samples."""

    n: int
    slope: float  # value units per second
    intercept: float
    resid_std: float  # scatter of the samples around the line
    t_start: float
    t_end: float

    @property
    def rise_in_window(self) -> float:
        return self.slope * (self.t_end - self.t_start)

    def at(self, t: float) -> float:
        return self.intercept + self.slope * t

    def beyond_noise(self, sigmas: float) -> bool:
        """The line rises, within the samples it was fitted to, by more than ``sigmas``
        times their scatter around it: a rise one can see, not a tilt of the noise."""
        return self.slope > 0 and self.rise_in_window > sigmas * self.resid_std


def fit_trend(times: Sequence[float], values: Sequence[float]) -> Trend | None:
    """The line through the samples, or None with fewer than 3 (no scatter to judge by)."""
    import numpy as np

    if len(times) != len(values):
        raise ValueError(f"{len(times)} times but {len(values)} values")
    if len(times) < 3:
        return None
    t = np.asarray(times, dtype=float)
    y = np.asarray(values, dtype=float)
    if np.ptp(t) == 0:
        return None
    slope, intercept = np.polyfit(t, y, 1)
    resid = y - (intercept + slope * t)
    return Trend(len(t), float(slope), float(intercept), float(np.std(resid, ddof=2)) if len(t) > 2 else 0.0,
                 float(t.min()), float(t.max()))


@dataclass(frozen=True)
class TrendRule:
    """When a series fails. RSS: the least-squares slope over the second half of the
    load (after warm-up), extrapolated over the whole load, grows by more than
    ``rss_growth_mb`` MB or ``rss_growth_pct`` % of the process's level, and the rise
    is beyond noise. Blocks in use: the slope over the load after ``warmup_fraction``,
    extrapolated over the whole load, rises by more than ``blocks_growth_pct`` % of the
    worker's KV pool (at least one block) and beyond noise. Beyond noise: the line rises
    within its own samples by more than ``noise_sigmas`` times their scatter around it.

    Blocks in use swing with the load (every running request holds its blocks), so a
    drift in the load itself (a machine that slows down, requests that spend longer on
    the decode worker) tilts their line too; the floor of ``blocks_growth_pct`` keeps
    that from reading as a leak. Smaller leaks are still caught: blocks in use must be
    exactly 0 on every worker once the load has drained."""

    rss_growth_mb: float = 50.0
    rss_growth_pct: float = 5.0
    blocks_growth_pct: float = 5.0
    noise_sigmas: float = 2.0
    warmup_fraction: float = 0.1
    settle_warn_s: float = 5.0  # blocks slower than this to reach 0 after the drain: a warning

    def describe(self) -> str:
        return (
            f"RSS fails when the least-squares slope over the second half of the load, "
            f"extrapolated over the whole load, grows by > {self.rss_growth_mb:g} MB or "
            f"> {self.rss_growth_pct:g} % of the process's level, and the fitted rise "
            f"within that half exceeds {self.noise_sigmas:g}x the scatter around the line; "
            f"blocks in use fail when the slope over the load after the first "
            f"{self.warmup_fraction:.0%}, extrapolated over the whole load, rises by more than "
            f"{self.blocks_growth_pct:g} % of the worker's KV pool (and >= 1 block) beyond the "
            f"same noise bound, or when any worker's blocks in use are not 0 after the drain; "
            f"any hung request fails the run."
        )


@dataclass
class Judgement:
    """One series' verdict; ``projected``: the fitted growth over the whole load."""

    name: str
    ok: bool
    message: str
    trend: Trend | None = None
    projected: float | None = None
    judged: bool = True

    def to_json(self) -> dict:
        return {**asdict(self), "trend": asdict(self.trend) if self.trend else None}


def judge_rss(name: str, times: Sequence[float], rss_bytes: Sequence[float], load_s: float,
              rule: TrendRule = TrendRule()) -> Judgement:
    """``times`` from the start of the load, samples of the load only; those in its
    second half count."""
    half = [(t, v) for t, v in zip(times, rss_bytes) if t >= load_s / 2]
    trend = fit_trend([t for t, _ in half], [v for _, v in half])
    if trend is None:
        return Judgement(name, True, f"{name}: too few samples in the second half to judge", judged=False)
    projected = trend.slope * load_s
    level = max(trend.at(trend.t_start), 1.0)
    too_big = projected > rule.rss_growth_mb * MB or projected > level * rule.rss_growth_pct / 100
    grows = too_big and trend.beyond_noise(rule.noise_sigmas)
    message = (
        f"{name}: RSS {'GROWS' if grows else 'flat'}: {trend.slope * 60 / MB:+.2f} MB/min over the second half, "
        f"{projected / MB:+.1f} MB ({100 * projected / level:+.1f} %) projected over {load_s:g} s "
        f"(scatter {trend.resid_std / MB:.1f} MB)"
    )
    return Judgement(name, not grows, message, trend, projected)


def judge_blocks(name: str, times: Sequence[float], blocks: Sequence[float], load_s: float,
                 rule: TrendRule = TrendRule(), pool_blocks: int | None = None) -> Judgement:
    """``times`` from the start of the load, samples of the load only; those in its
    first ``warmup_fraction`` (the ramp from idle) are left out. ``pool_blocks``: the worker's KV
    pool (None: any rise of a block or more beyond noise fails)."""
    start = load_s * rule.warmup_fraction
    kept = [(t, v) for t, v in zip(times, blocks) if t >= start]
    trend = fit_trend([t for t, _ in kept], [v for _, v in kept])
    if trend is None:
        return Judgement(name, True, f"{name}: too few samples to judge", judged=False)
    projected = trend.slope * load_s
    floor = max(1.0, pool_blocks * rule.blocks_growth_pct / 100) if pool_blocks else 1.0
    rises = projected >= floor and trend.beyond_noise(rule.noise_sigmas)
    of_pool = f" ({100 * projected / pool_blocks:+.1f} % of its {pool_blocks} blocks)" if pool_blocks else ""
    message = (
        f"{name}: {'RISE' if rises else 'flat'}: {trend.slope * 60:+.2f}/min, "
        f"{projected:+.1f} projected over {load_s:g} s{of_pool} (scatter {trend.resid_std:.1f})"
    )
    return Judgement(name, not rises, message, trend, projected)


@dataclass
class Verdict:
    """A soak run's outcome: failures (any one makes it FAIL) and warnings worth reading; ``judge``
    builds it, and the exit code follows it."""

    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def label(self) -> str:
        return "PASS" if self.ok else "FAIL"


def judge(samples: Sequence[dict], load_s: float, final_blocks: dict[str, int] | None, hung: int,
          rule: TrendRule = TrendRule(), settle_s: float | None = None,
          ) -> tuple[Verdict, list[Judgement], list[Judgement]]:
    """The run's verdict from its samples (see ``Sampler.sample`` for their shape):
    one judgement per process's RSS and per worker's blocks in use. ``settle_s``: how
    long the blocks in use took to reach 0 once every request had ended."""
    verdict = Verdict()
    load = [s for s in samples if s["phase"] in ("baseline", "load")]
    inflight = judge_blocks("requests in flight", [s["t"] for s in load], [s["in_flight"] for s in load], load_s, rule)
    rss_judgements = []
    for name in sorted({p for s in load for p in s["rss"]}):
        series = [(s["t"], s["rss"][name]["rss"], s["rss"][name]["pid"]) for s in load if name in s["rss"]]
        last_pid = series[-1][2]
        if len({pid for _, _, pid in series}) > 1:
            verdict.warnings.append(f"{name} changed pid during the run (restarted?); judged on pid {last_pid} only")
        same = [(t, v) for t, v, pid in series if pid == last_pid]
        j = judge_rss(name, [t for t, _ in same], [v for _, v in same], load_s, rule)
        if name in RAY_INTERNALS:
            j.judged, j.ok = False, True
            j.message += " (Ray's own process: not judged)"
        rss_judgements.append(j)
        if not j.ok:
            verdict.failures.append(j.message + ("" if inflight.ok else (
                " -- requests in flight rose too, and per-request state (connections, buffers, batches) grows "
                "with them: rerun longer or at a lower --capacity-fraction before calling it a leak")))
    block_judgements = []
    for worker in sorted({w for s in load for w in s["blocks"]}):
        series = [(s["t"], s["blocks"][worker]) for s in load if worker in s["blocks"]]
        pool = next((s["workers"][worker]["num_blocks"] for s in reversed(load) if worker in s.get("workers", {})),
                    None)
        j = judge_blocks(f"{worker} blocks in use", [t for t, _ in series], [v for _, v in series], load_s, rule,
                         pool)
        j.name = worker
        block_judgements.append(j)
        if not j.ok:
            why = j.message
            if not inflight.ok:
                why += (" -- requests in flight rose too: the service was over capacity at this rate, so this "
                        "may be queueing rather than a leak; rerun with a lower --capacity-fraction")
            elif final_blocks is not None and final_blocks.get(worker) == 0:
                why += (" -- yet they returned to 0 after the drain: requests held blocks longer as the load "
                        "went on (see the latency over time), no block was lost")
            verdict.failures.append(why)
    if not inflight.ok and all(j.ok for j in block_judgements):
        verdict.warnings.append(inflight.message + ": the offered load may be above capacity")
    if settle_s is not None and settle_s > rule.settle_warn_s and final_blocks and not any(final_blocks.values()):
        verdict.warnings.append(
            f"blocks in use took {settle_s:.1f} s to return to 0 after the last request ended: blocks of "
            f"finished or cancelled requests were held until a deadline freed them (a decode reservation "
            f"expires after transfer.timeout_s, 30 s by default), not freed when their request ended")
    if final_blocks is None:
        verdict.failures.append("could not read the blocks in use after the drain")
    else:
        left = {w: n for w, n in final_blocks.items() if n}
        if left:
            verdict.failures.append(f"blocks in use did not return to 0 after the drain: {left}")
    if hung:
        verdict.failures.append(f"{hung} request(s) hung: still open after the drain deadline")
    return verdict, rss_judgements, block_judgements
