"""The node's Prometheus scrape endpoint, covering every Tandem process on the node.

Each process (router replica, workers) writes its metrics into the shared folder
named by ``PROMETHEUS_MULTIPROC_DIR``; this endpoint merges them per scrape. The
folder must be set before any process imports prometheus-client, so ``tandem up``
calls ``use_multiprocess_dir`` first and passes the same folder to Ray's workers.

On a multi-node cluster (a KubeRay RayService) each pod sets the folder in its
environment and the controller keeps a ``NodeMetricsExporter`` actor pinned to every
node (``NodeExporters``), so every pod answers on the metrics port.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"


def process_metrics_dir(kind: str = "") -> str:
    """A fresh metrics folder for this process and the Ray it starts, under
    ``$TANDEM_HOME/metrics`` (named by ``kind`` and the pid), made this process's. The
    folders of processes no longer running are swept first: one killed before its
    shutdown (``remove_metrics_dir``) leaves its folder behind."""
    from engine.model.model_registry import tandem_home

    parent = tandem_home() / "metrics"
    sweep_dead_metrics_dirs(parent)
    return use_multiprocess_dir(parent / (f"{kind}-{os.getpid()}" if kind else str(os.getpid())))


def sweep_dead_metrics_dirs(parent: Path) -> list[Path]:
    """Remove the folders under ``parent`` named for a process (``[kind-]pid``) that is no
    longer running; returns them."""
    gone = []
    for entry in parent.iterdir() if parent.is_dir() else ():
        pid = entry.name.rpartition("-")[2]
        if entry.is_dir() and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry)
    return gone


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_metrics_dir(path: str | Path) -> None:
    """The service has shut down: its processes' metrics go with it."""
    shutil.rmtree(path, ignore_errors=True)


def use_multiprocess_dir(path: str | Path) -> str:
    """Empty ``path`` and make it this process's (and its children's) metrics folder."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.environ[ENV] = str(path)
    return str(path)


def start_metrics_server(port: int, host: str = "127.0.0.1"):
    """Serve the merged metrics of every process writing to the folder; returns the server.

    Always in the classic text format: prometheus-client's OpenMetrics output, which
    Prometheus asks for first, rewrites ``tandem:ttft`` to ``tandem_ttft``, and the
    names would no longer match vLLM's convention, the dashboard or the alert rules.
    """
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.environ[ENV])
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        return metrics_app({**environ, "HTTP_ACCEPT": "text/plain"}, start_response)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format, *args) -> None:  # a scrape every few seconds is not news
            pass

    server = make_server(host, port, app, Server, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server


class NodeMetricsExporter:
    """Serves its node's metrics folder; a Ray actor, pinned to the node it reports on."""

    def __init__(self, port: int, host: str) -> None:
        if not os.environ.get(ENV):
            raise RuntimeError(f"{ENV} is not set on this node: nothing to serve")
        self._server = start_metrics_server(port, host)

    def address(self) -> str:
        import ray

        return f"{ray.util.get_node_ip_address()}:{self._server.server_port}"


class NodeExporters:
    """One ``NodeMetricsExporter`` on every live node; ``sync()`` covers nodes that joined."""

    def __init__(self, port: int, host: str, name: str) -> None:
        self.port, self.host, self.name = port, host, name
        self._actors: dict[str, object] = {}  # node id -> actor handle

    def sync(self) -> list[str]:
        """Start exporters on nodes without one; returns the addresses of new ones."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for node_id in set(self._actors) - alive:
            del self._actors[node_id]
        started = {}
        for node_id in alive - set(self._actors):
            started[node_id] = (
                ray.remote(NodeMetricsExporter)
                .options(
                    name=f"{self.name}-metrics-{node_id[:12]}",
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote(self.port, self.host)
            )
        addresses = []
        for node_id, handle in started.items():
            try:
                addresses.append(ray.get(handle.address.remote(), timeout=60))
                self._actors[node_id] = handle
            except Exception as e:  # the port is taken, or the node has no metrics folder
                logger.warning("no metrics exporter on node %s: %s", node_id, e)
                ray.kill(handle)
                self._actors[node_id] = None  # don't retry every sync
        return addresses

    def addresses(self) -> list[str]:
        import ray

        handles = [h for h in self._actors.values() if h is not None]
        return sorted(ray.get([h.address.remote() for h in handles]))

    def shutdown(self) -> None:
        import ray

        for handle in self._actors.values():
            if handle is not None:
                ray.kill(handle)
        self._actors.clear()
