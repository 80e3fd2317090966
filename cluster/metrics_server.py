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
