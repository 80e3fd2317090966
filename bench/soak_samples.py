"""What the soak test records as it runs: each window's requests (``Tally``: outcomes and
latency percentiles, kept as float32 arrays so the driver's memory stays flat), and the
service's processes (found through Ray's state API, labelled by role), their RSS, the
metrics folder's series and size (``Sampler``)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.soak_verdict import RAY_INTERNALS
from load.results import RequestResult, percentile

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
