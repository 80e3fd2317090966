"""The cluster controller: one named Ray actor that owns a deployment's worker pools.

It starts the ``TandemCluster`` (pools, transfer group, health thread) and answers
the router's questions: which workers are live now (``workers``), what model they
serve (``model_info``), and, for tests and operators, their stats and blocks in use.
The router replicas poll ``workers()``, so a worker the health thread replaced is
picked up without restarting the Serve application.

Lifecycle: created -> ``start()`` (pools up) -> serving -> ``shutdown()`` (actors
killed, placement groups removed) -> the actor is killed by its owner.
"""

from __future__ import annotations

import logging
import threading

from cluster.config import ClusterConfig
from cluster.metrics_server import NodeExporters
from cluster.pools import TandemCluster

logger = logging.getLogger(__name__)


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

    def start(self) -> dict:
        """Start the pools (once: a redeployed application finds them running)."""
        if self._model_info is not None:
            return self._model_info
        self.cluster.start()
        self._model_info = self._read_model_info()
        if self._exporters is not None:
            self._exporters.sync()
            threading.Thread(target=self._sync_exporters, name="tandem-metrics-nodes", daemon=True).start()
        return self._model_info

    def _sync_exporters(self) -> None:
        while not self._stop.wait(self.NODE_SYNC_S):
            try:
                self._exporters.sync()
            except Exception:  # the GCS is briefly unreachable: try again next round
                logger.exception("syncing the metrics exporters failed")

    def metrics_addresses(self) -> list[str]:
        """Where each node's metrics are served (empty without ``metrics_port``)."""
        return self._exporters.addresses() if self._exporters is not None else []

    def _read_model_info(self) -> dict:
        from engine.model_config import ModelConfig
        from engine.model_registry import resolve_model

        engine = self.config.engine_config("decode")
        model = resolve_model(self.config.model)
        mc = ModelConfig.from_pretrained(model.path)
        stats = self.cluster.stats().values()
        return {
            "name": model.name,
            "model_dir": model.path,
            "max_model_len": min(engine.max_model_len or mc.max_model_len, mc.max_model_len),
            "vocab_size": mc.vocab_size,
            "block_size": engine.block_size,
            "max_kv_blocks": min(s["num_blocks"] for s in stats),
            "prefill_workers": self.config.prefill_workers,
            "decode_workers": self.config.decode_workers,
        }

    def model_info(self) -> dict:
        return self._model_info

    def dispatch_settings(self) -> dict:
        """The ``DispatchConfig`` fields that must agree with the workers' engines."""
        engine = self.config.engine_config("decode")
        return {
            "block_size": engine.block_size,
            "max_running_per_decode": engine.max_num_seqs,
            "max_retries": self.config.max_retries,
            "max_migrations": self.config.max_migrations,
        }

    def workers(self) -> tuple[list, list]:
        """The live (prefill, decode) ``WorkerRef``s."""
        return self.cluster.prefill_refs(), self.cluster.decode_refs()

    def stats(self) -> dict[str, dict]:
        return self.cluster.stats()

    def blocks_in_use(self) -> dict[str, int]:
        return self.cluster.blocks_in_use()

    def shutdown(self) -> None:
        self._stop.set()
        if self._exporters is not None:
            self._exporters.shutdown()
        self.cluster.shutdown()
