"""Soak test: the whole service under steady open-loop load for a long time, watching
for what only time shows: memory that creeps up, KV blocks that are never given back,
requests that never end.

    python -m bench.soak --duration-s 600 --capacity-fraction 0.8 --out-dir docs/soak

A run:

1. starts the service in-process (local Ray on ``--num-cpus``, 1 prefill + 1 decode
   worker, the ``collective`` KV transfer backend, metrics in a multiprocess folder as
   ``tandem up`` sets them up);
2. measures capacity (unless ``--rate``): ``--capacity-requests`` synthetic requests
   sent at once, completed requests/s;
3. sends Poisson arrivals at ``--capacity-fraction`` of it for ``--duration-s``; a
   seeded ``--cancel-fraction`` of the requests is cancelled part way: half after a
   random delay (often before the first token, while the request is queued, in prefill
   or in transfer), half after a random number of streamed chunks (while decoding);
4. every ``--sample-s`` records the RSS of every process of the service, the KV blocks
   in use on every worker, the requests in flight, and the latency percentiles of the
   requests that finished in that window;
5. stops sending, waits ``--drain-timeout-s`` for the requests in flight (those still
   open then hung), waits up to ``--settle-s`` for every worker's blocks in use to
   reach 0, and judges the trends (``judge_rss``, ``judge_blocks``).

Exit code 0 when the verdict is PASS, 1 when it is FAIL, 2 when the service never
served. Writes ``soak.json`` (every sample, the summary, the verdict), ``soak.png`` and
``soak.md`` (the markdown summary, also printed) in ``--out-dir``.

The client keeps no per-request records across windows (each window's latencies are
reduced to float32 arrays), so the driver's own memory stays flat and is judged like
every other process's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench import workloads
from bench.serve import HttpClient, RequestResult, RunPlan, open_client, percentile, run_load, warm_up
from bench.workloads import BenchRequest
from cluster.flags import add_service_flags

MB = 1 << 20
# Ray's own processes: recorded (a leak of Ray objects shows there) but not judged.
RAY_INTERNALS = ("raylet", "gcs_server")


# -- pure parts: cancellation, trends, verdict -------------------------------------


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


# -- per-window request tallies ------------------------------------------------------


LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "e2e_p99_ms")


def window_percentiles(ttft_s: Sequence[float], itl_s: Sequence[float], e2e_s: Sequence[float]) -> dict:
    """TTFT p50/p99, ITL p99 and E2E p99 in ms (None without samples)."""
    def pct(values: Sequence[float], q: float) -> float | None:
        return percentile([float(v) * 1000 for v in values], q) if len(values) else None

    return {
        "ttft_p50_ms": pct(ttft_s, 50),
        "ttft_p99_ms": pct(ttft_s, 99),
        "itl_p99_ms": pct(itl_s, 99),
        "e2e_p99_ms": pct(e2e_s, 99),
    }


class Tally:
    """Outcomes of the requests, in total and per sampling window; a window's latencies
    are kept as float32 arrays once the window closes (for start/middle/end percentiles)."""

    OUTCOMES = ("completed", "cancelled", "cancel_missed", "rejected", "errored", "hung")

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.sent = 0
        self.windows: list[tuple[float, object, object, object]] = []  # (end t, ttft, itl, e2e)
        self._open()

    def _open(self) -> None:
        self.window = Counter()
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._e2e: list[float] = []

    def record(self, outcome: str, result: RequestResult | None = None) -> None:
        self.totals[outcome] += 1
        self.window[outcome] += 1
        if outcome == "errored" and result is not None:
            self.errors[result.error or "unknown"] += 1
        if outcome == "completed" and result is not None:
            if result.ttft_s is not None:
                self._ttft.append(result.ttft_s)
            self._itl.extend(result.itl_s)
            if result.e2e_s is not None:
                self._e2e.append(result.e2e_s)

    def close_window(self, t: float) -> dict:
        """This window's counts and latency percentiles; opens the next window."""
        import numpy as np

        arrays = tuple(np.asarray(v, dtype=np.float32) for v in (self._ttft, self._itl, self._e2e))
        self.windows.append((t, *arrays))
        record = {**{k: self.window[k] for k in self.OUTCOMES}, **window_percentiles(*arrays)}
        self._open()
        return record

    def percentiles_between(self, t_from: float, t_to: float) -> dict:
        """Percentiles pooled over the windows that closed in (t_from, t_to]."""
        import numpy as np

        picked = [w for w in self.windows if t_from < w[0] <= t_to]
        pooled = [np.concatenate([w[i] for w in picked]) if picked else np.zeros(0, np.float32) for i in (1, 2, 3)]
        return {**window_percentiles(*pooled), "requests": int(len(pooled[2]))}


# -- processes of the service ------------------------------------------------------


def process_label(class_name: str, actor_name: str, cluster_name: str = "tandem") -> str:
    """A stable, short name for an actor's process: ``prefill-0``, ``router-replica``..."""
    if class_name in ("PrefillWorker", "DecodeWorker", "ColocatedWorker"):
        # actor names are "<cluster>-<worker_id>-<spawn number>"
        core = actor_name.removeprefix(f"{cluster_name}-")
        return core.rsplit("-", 1)[0] if core.count("-") >= 2 else core
    if class_name == "ClusterController":
        return "cluster-controller"
    if class_name == "ServeController":
        return "serve-controller"
    if class_name == "ProxyActor":
        return "serve-proxy"
    if class_name.startswith("ServeReplica:"):
        return "router-replica"
    return class_name


def discover_processes(cluster_name: str) -> dict[str, int]:
    """label -> pid for the driver, every live actor of this Ray, and Ray's raylet and
    GCS server (children of this driver when it started Ray)."""
    import psutil
    import ray

    found = {"driver": os.getpid()}
    try:
        # The GCS actor table, read directly: the state API needs the dashboard.
        actors = ray._private.state.actors()
    except Exception:  # pragma: no cover - private API moved: fall back to process titles
        actors = {}
    node = ray.get_runtime_context().get_node_id()
    seen: Counter[str] = Counter()
    for info in sorted(actors.values(), key=lambda a: a.get("Name", "")):
        if info.get("State") != "ALIVE" or not info.get("Pid") or info["Address"]["NodeID"] != node:
            continue
        label = process_label(info["ActorClassName"], info.get("Name", ""), cluster_name)
        seen[label] += 1
        found[label if seen[label] == 1 else f"{label}-{seen[label] - 1}"] = int(info["Pid"])
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            name = child.name()
            if name in RAY_INTERNALS:
                found[name] = child.pid
            elif not actors and name.startswith("ray::") and "IDLE" not in name:
                found[name.removeprefix("ray::").split(".")[0]] = child.pid
    return found


def rss_of(pids: dict[str, int]) -> dict[str, dict]:
    """label -> {pid, rss, shared} in bytes, for the processes still alive."""
    import psutil

    out = {}
    for label, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            mem = psutil.Process(pid).memory_info()
            out[label] = {"pid": pid, "rss": mem.rss, "shared": getattr(mem, "shared", 0)}
    return out


def metric_series(metrics_dir: str) -> int:
    """How many samples the node's merged metrics have: a label set that grows per
    request (a cardinality leak) shows here."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    return sum(len(family.samples) for family in registry.collect())


def dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


class Sampler:
    """Reads the service's state (blocking calls: run it in a thread)."""

    def __init__(self, controller, cluster_name: str, metrics_dir: str) -> None:
        self.controller = controller
        self.cluster_name = cluster_name
        self.metrics_dir = metrics_dir

    def workers(self) -> dict[str, dict] | None:
        """Each worker's engine state: blocks in use of its pool, requests it holds."""
        import ray

        try:
            stats = ray.get(self.controller.stats.remote(), timeout=30)
        except Exception:
            return None
        return {
            wid: {
                "blocks_in_use": s["num_blocks_in_use"], "num_blocks": s["num_blocks"],
                "running": s["num_running"], "waiting": s["num_waiting"], "swapped": s["num_swapped"],
                "preemptions": s["num_preemptions"],
                # A reservation that expires (its KV never came, nobody aborted it) counts as a timeout.
                "transfer_failures": dict((s.get("transfer") or {}).get("failures") or {}),
            }
            for wid, s in stats.items()
        }

    def blocks(self) -> dict[str, int] | None:
        workers = self.workers()
        return None if workers is None else {wid: w["blocks_in_use"] for wid, w in workers.items()}

    def sample(self) -> dict:
        rss = rss_of(discover_processes(self.cluster_name))
        workers = self.workers() or {}
        series = None
        with contextlib.suppress(Exception):
            series = metric_series(self.metrics_dir)
        return {
            "rss": rss,
            "blocks": {wid: w["blocks_in_use"] for wid, w in workers.items()},
            "workers": workers,
            "metrics_dir_bytes": dir_bytes(self.metrics_dir),
            "metric_series": series,
        }


# -- the load ------------------------------------------------------------------------


async def send_cancelled(client: HttpClient, request: BenchRequest, point: CancelPoint,
                         result: RequestResult) -> str:
    """Send ``request`` and walk away at ``point``; the outcome ("cancelled", or how it
    ended before the point came)."""
    if point.after_s is not None:
        try:
            await asyncio.wait_for(client.send(request, result), point.after_s)
        except asyncio.TimeoutError:
            return "cancelled"
        return "cancel_missed" if result.ok else outcome_of(result)
    # After N chunks: read the SSE stream ourselves and close it early, which closes the
    # connection (an unread body is never returned to the pool) and aborts the request.
    chunks = 0
    async with client.http.stream("POST", client.url, json=client.body(request), headers=client.headers) as r:
        if r.status_code != 200:
            result.fail(f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
            return outcome_of(result)
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return "cancel_missed"
            if json.loads(data).get("choices"):
                chunks += 1
                if chunks >= point.after_chunks:
                    return "cancelled"
    result.fail("incomplete_stream", "the stream ended without [DONE]")
    return outcome_of(result)


def outcome_of(result: RequestResult) -> str:
    if result.ok:
        return "completed"
    return "rejected" if result.error in ("http_429", "resource_exhausted") else "errored"


@dataclass(frozen=True)
class LoadPlan:
    """A soak run's open-loop load: request rate and duration, the requests' lengths, the share
    cancelled part way, and the seed that fixes arrivals, prompts and cancel points."""

    rate: float
    duration_s: float
    input_len: int
    output_len: int
    range_ratio: float
    cancel_fraction: float
    cancel_max_delay_s: float
    seed: int


def arrivals(plan: LoadPlan) -> list[float]:
    """Poisson send times in [0, duration): drawn with a margin, then cut."""
    mean = plan.rate * plan.duration_s
    n = int(mean + 10 * math.sqrt(mean) + 10)
    times = workloads.arrival_times(n, plan.rate, 1.0, random.Random(f"soak-arrivals:{plan.seed}"))
    return [t for t in times if t < plan.duration_s]


def requests(plan: LoadPlan, vocab: Sequence[int]) -> Iterator[tuple[BenchRequest, CancelPoint | None]]:
    """Synthetic requests, each with its cancel point; drawn one at a time so that no
    list of prompts sits in the driver for the whole run."""
    prompts = random.Random(f"soak-prompts:{plan.seed}")
    cancels = random.Random(f"soak-cancel:{plan.seed}")
    while True:
        (request,) = workloads.synthetic(1, plan.input_len, plan.output_len, plan.range_ratio, vocab, prompts)
        yield request, choose_cancel(cancels, plan.cancel_fraction, request.output_len, plan.cancel_max_delay_s)


class Soak:
    """Runs the open-loop load and the sampler together.

    Lifecycle: ``run()`` -> baseline sample -> load (sends until ``duration_s``, samples
    every ``sample_s``) -> drain (waits for the requests in flight; still open after
    ``drain_timeout_s``: hung, cancelled) -> settle (blocks in use back to 0 within
    ``settle_s``) -> final sample.
    """

    def __init__(self, client: HttpClient, sampler: Sampler, plan: LoadPlan, vocab: Sequence[int],
                 sample_s: float, drain_timeout_s: float, settle_s: float) -> None:
        self.client, self.sampler, self.plan, self.vocab = client, sampler, plan, vocab
        self.sample_s, self.drain_timeout_s, self.settle_s = sample_s, drain_timeout_s, settle_s
        self.tally = Tally()
        self.tasks: set[asyncio.Task] = set()
        self.samples: list[dict] = []
        self.phase = "baseline"
        self.t0 = 0.0
        self.times: dict[str, float] = {}
        self.final_blocks: dict[str, int] | None = None
        self._sampling = asyncio.Lock()  # the periodic and the phase-end samples never interleave

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def one(self, request: BenchRequest, point: CancelPoint | None) -> None:
        result = RequestResult(self.tally.sent, request.group, len(request.prompt_token_ids), request.output_len)
        try:
            if point is None:
                await self.client.send(request, result)
                outcome = outcome_of(result)
            else:
                outcome = await send_cancelled(self.client, request, point, result)
        except asyncio.CancelledError:
            self.tally.record("hung")
            raise
        except Exception as e:  # one broken request must not stop the soak
            result.fail("client_error", f"{type(e).__name__}: {e}")
            outcome = "errored"
        self.tally.record(outcome, result)

    async def take_sample(self) -> None:
        async with self._sampling:
            await self._take_sample()

    async def _take_sample(self) -> None:
        t = self.now()
        window = self.tally.close_window(t)
        in_flight = len(self.tasks)
        state = await asyncio.to_thread(self.sampler.sample)
        self.samples.append({"t": round(t, 3), "phase": self.phase, "in_flight": in_flight,
                             "sent": self.tally.sent, **state, "window": window,
                             "sample_cost_s": round(self.now() - t, 3)})
        mb = sum(p["rss"] for p in state["rss"].values()) / MB
        print(f"[{t:7.1f} s] {self.phase:8} sent {self.tally.sent:6d}  in flight {in_flight:4d}  "
              f"blocks {state['blocks']}  RSS total {mb:8.1f} MB  "
              f"done {window['completed']} cancelled {window['cancelled']} "
              f"errored {window['errored']} rejected {window['rejected']}", flush=True)

    async def sample_loop(self) -> None:
        k = 1
        while True:
            tick = k * self.sample_s
            k = max(k + 1, math.floor(self.now() / self.sample_s) + 1)  # a slow sample skips ticks
            if abs(tick - self.plan.duration_s) < self.sample_s / 2:
                continue  # run() samples the load's end itself
            await asyncio.sleep(max(0.0, tick - self.now()))
            await self.take_sample()

    async def send_loop(self) -> None:
        gen = requests(self.plan, self.vocab)
        for at in arrivals(self.plan):
            await asyncio.sleep(max(0.0, at - self.now()))
            request, point = next(gen)
            self.tally.sent += 1
            task = asyncio.create_task(self.one(request, point))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        await asyncio.sleep(max(0.0, self.plan.duration_s - self.now()))

    async def run(self) -> None:
        self.t0 = time.perf_counter()
        await self.take_sample()  # baseline, t = 0
        self.t0 = time.perf_counter()  # the load's clock starts once the baseline is read
        self.phase = "load"
        sampler = asyncio.create_task(self.sample_loop())
        try:
            await self.send_loop()
            self.times["load_end"] = self.now()
            await self.take_sample()  # the load's last point, exactly at its end
            self.phase = "drain"
            pending = set(self.tasks)
            if pending:
                _, pending = await asyncio.wait(pending, timeout=self.drain_timeout_s)
            self.times["drained"] = self.now()
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self.phase = "settle"
            self.final_blocks = await self.settle()
            self.times["settled"] = self.now()
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        self.phase = "final"
        await self.take_sample()

    async def settle(self) -> dict[str, int] | None:
        """Blocks in use once every worker reads 0, or as they stand at ``settle_s``."""
        deadline = self.now() + self.settle_s
        while True:
            blocks = await asyncio.to_thread(self.sampler.blocks)
            if (blocks is not None and not any(blocks.values())) or self.now() >= deadline:
                return blocks
            await asyncio.sleep(1.0)


# -- capacity -------------------------------------------------------------------------


async def measure_capacity(client: HttpClient, vocab: Sequence[int], n: int, input_len: int, output_len: int,
                           range_ratio: float, seed: int) -> dict:
    """``n`` synthetic requests sent at once: completed requests/s, and their TTFT."""
    rng = random.Random(f"soak-capacity:{seed}")
    batch = workloads.synthetic(n, input_len, output_len, range_ratio, vocab, rng)
    results, duration = await run_load(client, RunPlan(math.inf, batch, [0.0] * n), None, False)
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    return {
        "requests": n,
        "completed": len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration,
        "requests_per_s": len(done) / duration,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
    }


# -- the service ----------------------------------------------------------------------


@contextlib.contextmanager
def launched(args: argparse.Namespace) -> Iterator[tuple[object, str]]:
    """Ray and the whole service in this process, metrics as ``tandem up`` sets them up
    (``cluster.local``); yields (service, metrics folder)."""
    from cluster.local import local_ray
    from cluster.service import ServiceConfig, TandemService

    config = ServiceConfig.from_flags(args, free=True)
    with local_ray(args.num_cpus, metrics_kind="soak", log_to_driver=args.worker_logs) as metrics_dir:
        service = TandemService(config).start()
        try:
            yield service, metrics_dir
        finally:
            service.shutdown()


def ray_logs() -> str:
    try:
        import ray

        return ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # private API moved
        return "/tmp/ray/session_*/logs"


async def soak(args: argparse.Namespace, service, metrics_dir: str, vocab: Sequence[int]) -> dict:
    client_args = argparse.Namespace(backend="http", api_key=None, timeout=args.request_timeout_s,
                                     max_concurrency=None, served_model_name=None)
    async with open_client(client_args, service.http_url, service.grpc_target) as client:
        await warm_up(client, vocab, args.seed, service.http_url)
        capacity = None
        rate = args.rate
        if rate is None:
            t = time.perf_counter()
            capacity = await measure_capacity(client, vocab, args.capacity_requests, args.input_len,
                                              args.output_len, args.range_ratio, args.seed)
            capacity["wall_s"] = time.perf_counter() - t
            if not capacity["completed"]:
                raise RuntimeError(f"no request of the capacity burst completed: {capacity['errors']}")
            rate = capacity["requests_per_s"] * args.capacity_fraction
            print(f"capacity: {capacity['completed']}/{capacity['requests']} requests in "
                  f"{capacity['duration_s']:.1f} s = {capacity['requests_per_s']:.2f} req/s; "
                  f"soaking at {args.capacity_fraction:g} x = {rate:.2f} req/s", flush=True)
        max_delay = args.cancel_max_delay_s
        if max_delay is None:
            ttft = capacity and capacity["ttft_p50_s"]
            max_delay = min(max(ttft or 0.5, 0.05), 5.0)
        plan = LoadPlan(rate, args.duration_s, args.input_len, args.output_len, args.range_ratio,
                        args.cancel_fraction, max_delay, args.seed)
        sampler = Sampler(service.controller, service.config.cluster.name, metrics_dir)
        run = Soak(client, sampler, plan, vocab, args.sample_s, args.drain_timeout_s, args.settle_s)
        await run.run()
    return {"capacity": capacity, "plan": asdict(plan), "run": run}


# -- report ---------------------------------------------------------------------------


def build_report(args: argparse.Namespace, outcome: dict, timings: dict, rule: TrendRule) -> dict:
    run: Soak = outcome["run"]
    load_s = run.times.get("load_end", args.duration_s)
    settle_s = run.times["settled"] - run.times["drained"] if "settled" in run.times else None
    verdict, rss_j, block_j = judge(run.samples, load_s, run.final_blocks, run.tally.totals["hung"], rule,
                                    settle_s)
    errored = run.tally.totals["errored"]
    if errored:
        verdict.warnings.append(f"{errored} request(s) failed: {dict(run.tally.errors)}")
    # By finish time; the last third takes the window that closes the load, the drain's do not count.
    last = max((s["t"] for s in run.samples if s["phase"] == "load"), default=load_s) + 0.001
    thirds = [(0.0, load_s / 3), (load_s / 3, 2 * load_s / 3), (2 * load_s / 3, last)]
    return {
        "started": timings["started"],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items()},
        "rule": rule.describe(),
        "capacity": outcome["capacity"],
        "plan": outcome["plan"],
        "timings_s": {**{k: round(v, 1) for k, v in run.times.items()},
                      **{k: round(v, 1) for k, v in timings.items() if k != "started"}},
        "counts": {"sent": run.tally.sent, **{k: run.tally.totals[k] for k in Tally.OUTCOMES},
                   "errors": dict(run.tally.errors)},
        "latency": dict(zip(("start", "middle", "end"), (run.tally.percentiles_between(a, b) for a, b in thirds))),
        "final_blocks": run.final_blocks,
        "verdict": {"result": verdict.label, "failures": verdict.failures, "warnings": verdict.warnings},
        "rss": [j.to_json() for j in rss_j],
        "blocks": [j.to_json() for j in block_j],
        "samples": run.samples,
    }


def _num(v, fmt=".1f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(report: dict) -> str:
    load = [s for s in report["samples"] if s["phase"] in ("baseline", "load")]
    lines = [*_md_setup(report), *_md_rss(report, load), *_md_blocks(report, load), *_md_latency(report),
             *_md_outcome(report)]
    return "\n".join(lines)


def _md_setup(report: dict) -> list[str]:
    plan, cap, config = report["plan"], report["capacity"], report["config"]
    rate = f"{plan['rate']:.2f} req/s" + (f" ({config['capacity_fraction']:g} x measured capacity "
                                          f"{cap['requests_per_s']:.2f} req/s)" if cap else "")
    return [
        f"### Soak: {report['verdict']['result']}",
        "",
        f"{plan['duration_s']:g} s of Poisson load at {rate}, {plan['input_len']}-token prompts, "
        f"{plan['output_len']}-token outputs (±{plan['range_ratio']:.0%}), {plan['cancel_fraction']:.0%} cancelled "
        f"mid-request; {config['prefill_workers']} prefill + {config['decode_workers']} decode "
        f"worker(s), `{config['kv_transfer_backend']}` transfer, {report['machine']['cpus']} CPUs; "
        f"sampled every {config['sample_s']:g} s. Started {report['started']}.",
    ]


def _md_rss(report: dict, load: list[dict]) -> list[str]:
    lines = ["", "| process | RSS start (MB) | RSS end of load (MB) | RSS after drain (MB) | slope, 2nd half (MB/min) "
                 "| projected over the load (MB) | |",
             "|---|---:|---:|---:|---:|---:|---|"]
    final = report["samples"][-1]["rss"]
    for j in report["rss"]:
        name = j["name"]
        first = next((s["rss"][name]["rss"] for s in load if name in s["rss"]), None)
        last = next((s["rss"][name]["rss"] for s in reversed(load) if name in s["rss"]), None)
        slope = j["trend"]["slope"] * 60 / MB if j["trend"] else None
        mark = ("ok" if j["ok"] else "**GROWS**") if j["judged"] else "not judged"
        lines.append(
            f"| {name} | {_num(first and first / MB)} | {_num(last and last / MB)} | "
            f"{_num(final[name]['rss'] / MB if name in final else None)} | {_num(slope, '+.2f')} | "
            f"{_num(j['projected'] / MB if j['projected'] is not None else None, '+.1f')} | {mark} |"
        )
    return lines


def _md_blocks(report: dict, load: list[dict]) -> list[str]:
    lines = ["", "| worker | KV pool (blocks) | blocks in use: mean | max | slope (blocks/min) | after drain | |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for j in report["blocks"]:
        values = [s["blocks"][j["name"]] for s in load if j["name"] in s["blocks"]]
        pool = next((s["workers"][j["name"]]["num_blocks"] for s in reversed(load)
                     if j["name"] in s.get("workers", {})), None)
        after = (report["final_blocks"] or {}).get(j["name"])
        ok = j["ok"] and after == 0
        mean = sum(values) / len(values) if values else None
        slope = j["trend"]["slope"] * 60 if j["trend"] else None
        lines.append(
            f"| {j['name']} | {_num(pool, 'd')} | {_num(mean)} | {max(values, default='-')} | "
            f"{_num(slope, '+.2f')} | {_num(after, 'd')} | {'ok' if ok else '**FAIL**'} |"
        )
    return lines


def _md_latency(report: dict) -> list[str]:
    lines = ["", "| requests finished in | requests | TTFT p50 (ms) | TTFT p99 (ms) | ITL p99 (ms) "
                 "| E2E p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|"]
    for part, p in report["latency"].items():
        lines.append(f"| the {part} third of the load | {p['requests']} | {_num(p['ttft_p50_ms'])} | "
                     f"{_num(p['ttft_p99_ms'])} | {_num(p['itl_p99_ms'])} | {_num(p['e2e_p99_ms'])} |")
    return lines


def _md_outcome(report: dict) -> list[str]:
    counts, t = report["counts"], report["timings_s"]
    failures = {w: v["transfer_failures"] for w, v in report["samples"][-1].get("workers", {}).items()
                if v.get("transfer_failures")}
    lines = [
        "",
        f"KV transfer failures (incl. reservations expired by their deadline): {failures or 'none'}.",
        f"Requests: {counts['sent']} sent, {counts['completed']} completed, {counts['cancelled']} cancelled "
        f"(+{counts['cancel_missed']} finished before their cancel point), {counts['rejected']} rejected (429), "
        f"{counts['errored']} errored{' ' + str(counts['errors']) if counts['errors'] else ''}, "
        f"{counts['hung']} hung.",
        f"Wall time: {t.get('total', 0):.0f} s (startup {t.get('startup', 0):.0f} s, capacity "
        f"{t.get('capacity', 0):.0f} s, load {t.get('load_end', 0):.0f} s, drain "
        f"{t.get('drained', 0) - t.get('load_end', 0):.1f} s, blocks to 0 "
        f"{t.get('settled', 0) - t.get('drained', 0):.1f} s, shutdown {t.get('shutdown', 0):.0f} s).",
        "",
        f"Rule: {report['rule']}",
        "",
        f"**{report['verdict']['result']}**",
    ]
    lines += [f"- FAIL: {f}" for f in report["verdict"]["failures"]]
    lines += [f"- warning: {w}" for w in report["verdict"]["warnings"]]
    return lines


def write_plot(report: dict, path: Path) -> Path:
    """RSS per process, blocks in use (and requests in flight), and window latency
    percentiles over time: three stacked panels."""
    from bench import plots  # sets the Agg backend

    plt = plots.plt
    samples = report["samples"]
    ts = [s["t"] for s in samples]
    fig, (ax_rss, ax_blocks, ax_lat) = plt.subplots(3, 1, figsize=(11, 12), sharex=True, constrained_layout=True)
    for name in sorted({p for s in samples for p in s["rss"]}):
        points = [(s["t"], s["rss"][name]["rss"] / MB) for s in samples if name in s["rss"]]
        start = points[0][1]
        ax_rss.plot([t for t, _ in points], [v - start for _, v in points], marker=".",
                    label=f"{name} (from {start:.0f} MB)")
    ax_rss.set_ylabel("RSS change (MB)")
    ax_rss.set_title("resident memory per process, change since the start")
    ax_rss.legend(fontsize="small", ncol=3)
    for worker in sorted({w for s in samples for w in s["blocks"]}):
        points = [(s["t"], s["blocks"][worker]) for s in samples if worker in s["blocks"]]
        ax_blocks.plot(*zip(*points), marker=".", label=f"{worker} blocks in use")
    ax_blocks.plot(ts, [s["in_flight"] for s in samples], color="gray", linestyle="--", label="requests in flight")
    ax_blocks.set_ylabel("count")
    ax_blocks.set_title("KV blocks in use per worker, requests in flight")
    ax_blocks.legend(fontsize="small")
    for key in LATENCY_KEYS:
        points = [(s["t"], s["window"][key]) for s in samples if s["window"][key] is not None]
        if points:
            ax_lat.plot(*zip(*points), marker=".", label=key.replace("_ms", "").replace("_", " "))
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("latency of the requests finished in each window")
    ax_lat.set_xlabel("seconds from the start of the load")
    ax_lat.legend(fontsize="small")
    load_end = report["timings_s"].get("load_end")
    for ax in (ax_rss, ax_blocks, ax_lat):
        ax.grid(alpha=0.3)
        if load_end is not None:
            ax.axvline(load_end, color="black", linewidth=0.8, linestyle=":")
    fig.suptitle(f"Tandem soak: {report['verdict']['result']}")
    return plots._save(fig, path)


# -- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    load = ap.add_argument_group("load")
    load.add_argument("--duration-s", type=float, default=600.0, help="length of the load (default 600)")
    rate = load.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, default=None, help="requests/s; skips the capacity measurement")
    rate.add_argument("--capacity-fraction", type=float, default=0.8, help="of the measured capacity (0.8)")
    load.add_argument("--capacity-requests", type=int, default=32, help="sent at once to measure capacity")
    load.add_argument("--cancel-fraction", type=float, default=0.1, help="requests cancelled part way (0.1)")
    load.add_argument("--cancel-max-delay-s", type=float, default=None,
                      help="delay-based cancels fall in [0, this) (default: the capacity burst's TTFT p50)")
    load.add_argument("--input-len", type=int, default=128)
    load.add_argument("--output-len", type=int, default=64)
    load.add_argument("--range-ratio", type=float, default=0.25, help="lengths uniform in LEN * (1 ± RATIO)")
    load.add_argument("--request-timeout-s", type=float, default=300.0, help="client read timeout")
    load.add_argument("--seed", type=int, default=0)

    watch = ap.add_argument_group("watching and judging")
    watch.add_argument("--sample-s", type=float, default=5.0, help="sampling period (5)")
    watch.add_argument("--drain-timeout-s", type=float, default=120.0,
                       help="after the load, requests still open after this hung (120)")
    watch.add_argument("--settle-s", type=float, default=60.0, help="wait this long for blocks in use to reach 0")
    watch.add_argument("--rss-growth-mb", type=float, default=TrendRule.rss_growth_mb)
    watch.add_argument("--rss-growth-pct", type=float, default=TrendRule.rss_growth_pct)
    watch.add_argument("--blocks-growth-pct", type=float, default=TrendRule.blocks_growth_pct,
                       help="of the worker's KV pool, projected over the load")
    watch.add_argument("--out-dir", default="docs/soak", help="soak.json, soak.png, soak.md (docs/soak)")

    svc = ap.add_argument_group("service")
    add_service_flags(svc, config_file=False, admission=False, prefill_workers=1, decode_workers=1,
                      kv_transfer_backend="collective", num_cpus=2)  # fmt: skip
    svc.add_argument("--worker-logs", action="store_true",
                     help="stream the Ray processes' logs here (default: only in the logs folder printed at startup)")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    checks = [
        (args.duration_s > 0, "--duration-s must be > 0"),
        (args.rate is None or args.rate > 0, "--rate must be > 0"),
        (0 < args.capacity_fraction, "--capacity-fraction must be > 0"),
        (args.capacity_requests >= 1, "--capacity-requests must be >= 1"),
        (0 <= args.cancel_fraction <= 1, "--cancel-fraction must be in [0, 1]"),
        (args.cancel_max_delay_s is None or args.cancel_max_delay_s > 0, "--cancel-max-delay-s must be > 0"),
        (args.input_len >= 1 and args.output_len >= 2, "--input-len must be >= 1 and --output-len >= 2"),
        (0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.sample_s > 0, "--sample-s must be > 0"),
        (args.duration_s >= 3 * args.sample_s, "--duration-s must be at least 3 samples (--sample-s) long"),
        (args.prefill_workers >= 1 and args.decode_workers >= 1, "--prefill-workers and --decode-workers >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            ap.error(message)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    rule = TrendRule(rss_growth_mb=args.rss_growth_mb, rss_growth_pct=args.rss_growth_pct,
                     blocks_growth_pct=args.blocks_growth_pct)
    from engine.default_model import ensure_default_model
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer

    model_dir = args.model or str(ensure_default_model())
    vocab = workloads.sampleable_ids(Tokenizer.from_pretrained(model_dir))
    context = ModelConfig.from_pretrained(model_dir).max_model_len
    workloads.check_fits([BenchRequest([0] * math.ceil(args.input_len * (1 + args.range_ratio)),
                                       math.ceil(args.output_len * (1 + args.range_ratio)))], context)
    timings = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        with launched(args) as (service, metrics_dir):
            timings["startup"] = time.perf_counter() - t_start
            print(f"service up in {timings['startup']:.0f} s at {service.http_url}; Ray logs in {ray_logs()}",
                  flush=True)
            t = time.perf_counter()
            outcome = asyncio.run(soak(args, service, metrics_dir, vocab))
            run = outcome["run"]
            timings["capacity"] = time.perf_counter() - t - run.now()
            t_down = time.perf_counter()
        timings["shutdown"] = time.perf_counter() - t_down
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timings["total"] = time.perf_counter() - t_start
    report = build_report(args, outcome, timings, rule)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    write_plot(report, out / "soak.png")
    summary = markdown(report)
    (out / "soak.md").write_text(summary + "\n")
    print()
    print(summary)
    print(f"\nwrote {out / 'soak.json'}, {out / 'soak.png'}, {out / 'soak.md'}")
    return 0 if report["verdict"]["result"] == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
