"""The node's Prometheus scrape endpoint, covering every Tandem process on the node.

Each process (router replica, workers) writes its metrics into the shared folder
named by ``PROMETHEUS_MULTIPROC_DIR``; this endpoint merges them per scrape. The
folder must be set before any process imports prometheus-client, so ``tandem up``
calls ``use_multiprocess_dir`` first and passes the same folder to Ray's workers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"


def use_multiprocess_dir(path: str | Path) -> str:
    """Empty ``path`` and make it this process's (and its children's) metrics folder."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.environ[ENV] = str(path)
    return str(path)


def start_metrics_server(port: int, host: str = "127.0.0.1"):
    """Serve the merged metrics of every process writing to the folder; returns the server."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.environ[ENV])
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
