"""One local Ray per test session, shut down at the end; small checkpoints for speed."""

from __future__ import annotations

import contextlib
import os

import pytest


@pytest.fixture(scope="session")
def metrics_dir(tmp_path_factory) -> str:
    """Where every Ray process of the session writes its Prometheus metrics."""
    return str(tmp_path_factory.mktemp("prometheus-multiproc"))


@pytest.fixture(scope="session")
def ray_cluster(tandem_home, metrics_dir):
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    env = {"TANDEM_HOME": str(tandem_home), "OMP_NUM_THREADS": "1", "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    # The driver too: clusters started here mark their dead workers' gauges in it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


def scrape(metrics_dir: str) -> dict[tuple, float]:
    """The node's merged metrics, as the scrape endpoint serves them: (name, labels) -> value."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    out: dict[tuple, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pid"))
            out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
    return out


def metric_sum(samples: dict[tuple, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model):
    """A 2-layer Llama with the default tokenizer: fast enough for many workers on 2 cores."""
    from tests.conftest import build_hf_checkpoint

    return str(build_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", default_model, seed=3))


def free_port() -> int:
    """A port free now, outside the ephemeral range (see ``cluster.service.SPARE_PORTS``):
    the service binds it tens of seconds later, after its workers opened connections."""
    from cluster.service import free_ports

    return free_ports("127.0.0.1", 1)[0]


@contextlib.contextmanager
def running_service(
    model: str,
    router=None,
    prefill_workers: int = 1,
    num_kv_blocks: int = 512,
    decode_workers: int = 1,
    ingress: str | None = None,
    **cluster,
):
    """The whole service (workers, controller, Serve app) on free ports; shut down on exit.

    ``cluster`` overrides topology settings (``transfer``, ``restart_workers``, ...).
    ``ingress``: Serve's ingress (cluster/ingress.py); by default ``$TANDEM_TEST_INGRESS``,
    else the service's default, so the same tests run on either.
    """
    from cluster.config import ClusterConfig
    from cluster.service import ServiceConfig, TandemService, free_ports
    from router.server import RouterConfig

    settings = {
        "model": model,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
        "transfer": {"backend": "object_store"},
        "engine": {"num_kv_blocks": num_kv_blocks},
        "restart_workers": False,
        **cluster,
    }
    ingress = ingress or os.environ.get("TANDEM_TEST_INGRESS") or ServiceConfig.ingress
    http_port, grpc_port = free_ports("127.0.0.1", 2)
    cfg = ServiceConfig(
        cluster=ClusterConfig.from_dict(settings),
        router=router or RouterConfig(),
        http_port=http_port,
        grpc_port=grpc_port,
        ingress=ingress,
    )
    svc = TandemService(cfg).start()
    try:
        yield svc
    finally:
        svc.shutdown()
