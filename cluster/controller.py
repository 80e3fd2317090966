"""The cluster controller: one named Ray actor that owns a deployment's worker pools.

It starts the ``TandemCluster`` (pools, health thread, control loop) and answers
the router's questions: which workers are live now (``workers``), what model they
serve (``model_info``), and, for tests and operators, their stats and blocks in use.
The router replicas poll ``workers()``, so a worker the health thread replaced is
picked up without restarting the Serve application.

Lifecycle: created -> ``start()`` (pools up) -> serving -> ``shutdown()`` (actors
killed, placement groups removed) -> the actor is killed by its owner. ``start()`` may
be called any number of times, also at once (a RayService's app builder calls it on
each build): one start runs at a time, callers meanwhile share its outcome, and after
a success every call returns its result. A failed start removed what it placed; the
next call starts afresh.

Its name (``controller_name``) carries a hash of the settings it runs with, so a
deployment whose topology changed gets a new controller; ``retire_other_controllers``
stops the ones a deployment of the same name started with other settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import threading
import time
from concurrent.futures import Future

import ray

from cluster.config import ClusterConfig
from cluster.elastic import PoolScaler
from cluster.metrics_server import NodeExporters
from cluster.pools import TandemCluster
from engine.wire.metrics import PoolMetrics
from kv_transfer.config import TransferConfig
from router.latency import LatencyReport, merge

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0
LATENCY_REPORT_TTL_S = 5.0  # a router's latency report counts this long (they come every second)


def controller_name(config: ClusterConfig, metrics_port: int | None = None) -> str:
    """``<name>-controller-<hash>``: the hash covers every setting the controller and its
    pools run with (``start_timeout_s`` aside: it only bounds how long a start may take)."""
    settings = dataclasses.asdict(config)
    del settings["start_timeout_s"]
    settings["metrics_port"] = metrics_port
    text = json.dumps(settings, sort_keys=True, default=str)
    return f"{config.name}-controller-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def retire_other_controllers(keep: str) -> list[str]:
    """Stop the named controllers of ``keep``'s deployment (in this Ray namespace) that
    run other settings, and with them their pools and placement groups, which would
    otherwise hold the resources the new settings need. Returns their names."""
    prefix = keep[: keep.rindex("-") + 1]
    pattern = re.compile(re.escape(prefix) + r"[0-9a-f]{12}")
    retired = [n for n in ray.util.list_named_actors() if pattern.fullmatch(n) and n != keep]
    for name in retired:
        logger.warning("stopping controller %s: its settings differ from %s's", name, keep)
        try:
            handle = ray.get_actor(name)
        except ValueError:  # gone meanwhile
            continue
        try:
            ray.get(handle.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        except Exception:  # killed anyway: its placement groups go with it
            logger.exception("controller %s did not shut down cleanly", name)
        ray.kill(handle, no_restart=True)
    return retired


class ClusterController:
    """``metrics_port``: when set, serve every node's metrics there (one exporter per
    node, also on nodes that join later); ``tandem up`` serves its single node itself."""

    NODE_SYNC_S = 10.0

    def __init__(self, config: ClusterConfig, metrics_port: int | None = None, metrics_host: str = "0.0.0.0") -> None:
        self.config = config
        self.cluster = TandemCluster(config)
        self._model_info: dict | None = None
        self._exporters = NodeExporters(metrics_port, metrics_host, config.name) if metrics_port else None
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._started: Future | None = None  # the last start's outcome, or the one running
        self.scaler: PoolScaler | None = None  # the pools' control loop, with ``autoscaling``
        self._latency: dict[str, tuple[float, LatencyReport]] = {}  # router replica -> (when, its report)
        self._latency_lock = threading.Lock()

    def start(self, start_timeout_s: float | None = None) -> dict:
        """Start the pools and return the model's description. Idempotent (see the
        module's docstring): a redeployed application finds the pools running.
        ``start_timeout_s``: the bound of a start this call begins (the controller's name
        leaves it out, so a build with a changed timeout finds this controller)."""
        with self._start_lock:
            attempt = self._started
            mine = attempt is None or (attempt.done() and attempt.exception() is not None)
            if mine:
                attempt = self._started = Future()
                if start_timeout_s is not None:
                    self.config = dataclasses.replace(self.config, start_timeout_s=start_timeout_s)
        if mine:
            try:
                attempt.set_result(self._start())
            except BaseException as e:  # every caller waiting on this start gets it
                attempt.set_exception(e)
        return attempt.result()

    def _start(self) -> dict:
        cluster = TandemCluster(self.config).start()  # a failed start removed its pools itself
        try:
            model_info = self._read_model_info(cluster)
            if self._exporters is not None:
                self._exporters.sync()
        except BaseException:
            cluster.shutdown()
            raise
        self.cluster, self._model_info = cluster, model_info
        pool_metrics = PoolMetrics(model_info["name"])
        cluster.on_role_switch = pool_metrics.on_role_switch  # every switch, the loop's or an operator's
        if self.config.autoscaling is not None:
            self.scaler = PoolScaler(cluster, self.config.autoscaling, pool_metrics, latency=self.router_latency)
            threading.Thread(target=self.scaler.run, args=(self._stop,), name="tandem-autoscaling", daemon=True).start()
        if self._exporters is not None:
            threading.Thread(target=self._sync_exporters, name="tandem-metrics-nodes", daemon=True).start()
        return model_info

    def _sync_exporters(self) -> None:
        while not self._stop.wait(self.NODE_SYNC_S):
            try:
                self._exporters.sync()
            except Exception:  # the GCS is briefly unreachable: try again next round
                logger.exception("syncing the metrics exporters failed")

    def metrics_addresses(self) -> list[str]:
        """Where each node's metrics are served (empty without ``metrics_port``)."""
        return self._exporters.addresses() if self._exporters is not None else []

    def _read_model_info(self, cluster: TandemCluster) -> dict:
        from engine.model.model_config import ModelConfig
        from engine.model.model_registry import resolve_model

        engine = self.config.engine_config("decode")
        model = resolve_model(self.config.model)
        mc = ModelConfig.from_pretrained(model.path)
        stats = cluster.stats().values()
        return {
            "name": model.name,
            "model_dir": model.path,
            "max_model_len": min(engine.max_model_len or mc.max_model_len, mc.max_model_len),
            "vocab_size": mc.vocab_size,
            "block_size": engine.block_size,
            "max_kv_blocks": min(s["num_blocks"] for s in stats),
            "prefill_workers": self.config.prefill_workers,
            "decode_workers": self.config.decode_workers,
            "scheduling_policy": engine.policy,
            "adapters": self._served_adapters(),
        }

    def _served_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters every worker loads at start (both pools' engines name them)."""
        names = set(self.config.engine_config("decode").lora_adapters)
        if self.config.prefill_workers:
            names &= set(self.config.engine_config("prefill").lora_adapters)
        return tuple(sorted(names))

    def model_info(self) -> dict:
        return self._model_info

    def dispatch_settings(self) -> dict:
        """The ``DispatchConfig`` fields the deployment sets (``ClusterConfig.dispatch_settings``)."""
        return self.config.dispatch_settings()

    def workers(self) -> tuple[list, list]:
        """The live (prefill, decode) ``WorkerRef``s."""
        return self.cluster.prefill_refs(), self.cluster.decode_refs()

    def stats(self) -> dict[str, dict]:
        return self.cluster.stats()

    def add_worker(self, role: str) -> str:
        """Start one more ``role`` ("prefill" or "decode") worker; its id, once listed."""
        return self.cluster.add_worker(role)

    def drain_worker(self, worker_id: str, timeout_s: float = 60.0) -> dict:
        """Take a worker out of its pool without losing a request (``TandemCluster.drain_worker``)."""
        return self.cluster.drain_worker(worker_id, timeout_s)

    def switch_worker(self, worker_id: str, role: str, timeout_s: float = 60.0) -> dict:
        """Move a warm worker to the other pool without restarting it (``TandemCluster.switch_worker``)."""
        return self.cluster.switch_worker(worker_id, role, timeout_s)

    def report_latency(self, router: str, report: LatencyReport) -> None:
        """A router replica's recent TTFT / ITL (it reports with each worker-list refresh)."""
        with self._latency_lock:
            self._latency[router] = (time.monotonic(), report)

    def router_latency(self) -> LatencyReport | None:
        """What the routers' clients saw lately: the worst p90 among the replicas that
        reported within ``LATENCY_REPORT_TTL_S`` (None: no request anywhere lately)."""
        now = time.monotonic()
        with self._latency_lock:
            for router in [r for r, (at, _) in self._latency.items() if now - at > LATENCY_REPORT_TTL_S]:
                del self._latency[router]  # a replica that stopped reporting is gone
            reports = [report for _, report in self._latency.values()]
        return merge(reports)

    def autoscaling(self) -> dict | None:
        """The control loop's pending changes and latest decisions (None: pools of fixed size)."""
        return None if self.scaler is None else self.scaler.status()

    def status(self) -> dict:
        """What ``tandem status`` prints: the model, each pool's workers and loads, and,
        with autoscaling, each pool's bounds, target and the latest decisions."""
        pools = self.cluster.status()
        out = {"model": self._model_info.get("name") if self._model_info else None, "pools": pools,
               "autoscaling": None}
        if self.scaler is not None:
            scaling, bounds = self.scaler.status(), self.config.autoscaling
            latency = self.router_latency()
            out["autoscaling"] = {**scaling, "slo": dataclasses.asdict(bounds.slo),
                                  "router_latency": None if latency is None else dataclasses.asdict(latency),
                                  "targets": {
                role: {"workers": (n := sum(not w["draining"] for w in pools.get(role, []))),
                       "target": n + scaling["pending"].get(role, 0),
                       "min": bounds.bounds(role).min_workers, "max": bounds.bounds(role).max_workers}
                for role in ("prefill", "decode")
            }}
        return out

    def set_transfer(self, transfer: TransferConfig) -> None:
        """New transfer settings (deadlines, failure policy, faults) for the running
        workers and their future replacements; see ``TandemCluster.set_transfer``."""
        self.cluster.set_transfer(transfer)

    def blocks_in_use(self) -> dict[str, int]:
        return self.cluster.blocks_in_use()

    def shutdown(self) -> None:
        self._stop.set()
        if self._exporters is not None:
            self._exporters.shutdown()
        self.cluster.shutdown()
