"""The whole service on a Ray cluster: worker pools, their controller, and the router.

``TandemService(config, ...).start()`` starts the controller actor (which starts the
pools), Serve's HTTP and gRPC proxies, and the router application; ``shutdown()``
takes them down in reverse order. ``tandem up`` and the integration tests use it;
the caller owns ``ray.init`` / ``ray.shutdown``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ray

from cluster.config import ClusterConfig
from cluster.controller import ClusterController
from cluster.pools import READY_TIMEOUT_S
from router.admission import AdmissionConfig
from router.dispatch import DispatchConfig
from router.server import GRPC_SERVICERS, Router, RouterConfig



@dataclass(frozen=True)
class ServiceConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000
    app_name: str = "tandem"


class TandemService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.controller = None
        self.model_info: dict | None = None

    def start(self) -> "TandemService":
        from ray import serve
        from ray.serve.config import gRPCOptions

        cfg = self.config
        self.controller = (
            ray.remote(ClusterController)
            .options(name=f"{cfg.cluster.name}-controller", num_cpus=0, max_concurrency=16)
            .remote(cfg.cluster)
        )
        try:
            self.model_info = ray.get(self.controller.start.remote(), timeout=READY_TIMEOUT_S)
            serve.start(
                http_options={"host": cfg.host, "port": cfg.http_port},
                grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=GRPC_SERVICERS),
            )
            serve.run(Router.bind(self.controller, cfg.router), name=cfg.app_name, route_prefix="/")
        except BaseException:
            self.shutdown()
            raise
        return self

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    def blocks_in_use(self) -> dict[str, int]:
        return ray.get(self.controller.blocks_in_use.remote())

    def stats(self) -> dict[str, dict]:
        return ray.get(self.controller.stats.remote())

    def shutdown(self) -> None:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            if self.controller is not None:
                try:
                    ray.get(self.controller.shutdown.remote(), timeout=60)
                finally:
                    ray.kill(self.controller)
                    self.controller = None


def configs_from_args(args: dict) -> tuple[ClusterConfig, RouterConfig]:
    """The deployment a RayService's ``serveConfigV2`` application args describe.

    ``args``: ``topology`` (the keys of a ``tandem up --config`` file),
    ``worker_resources`` (custom Ray resources per role, pinning each pool to its
    worker group) and ``router`` (admission bounds, placement, and ``api_key_env``:
    the environment variable holding the API key, so the key never sits in the config).
    """
    topology = dict(args.get("topology") or {})
    for role, custom in (args.get("worker_resources") or {}).items():
        key = f"{role}_resources"
        resources = dict(topology.get(key) or {})
        resources["custom"] = {**resources.get("custom", {}), **custom}
        topology[key] = resources
    r = args.get("router") or {}
    defaults = AdmissionConfig()
    router = RouterConfig(
        admission=AdmissionConfig(
            max_requests=r.get("max_outstanding_requests", defaults.max_requests),
            max_prompt_tokens=r.get("max_outstanding_prompt_tokens", defaults.max_prompt_tokens),
        ),
        dispatch=DispatchConfig(placement=r.get("placement", "load")),
        api_key=os.environ.get(r["api_key_env"]) if r.get("api_key_env") else None,
    )
    return ClusterConfig.from_dict(topology), router


def app(args: dict):
    """Serve application builder for a RayService (``serveConfigV2`` in ``deploy/helm``).

    The controller is a named detached actor, so a redeploy finds the pools it
    started still running. With ``metrics_port`` in ``args`` it serves every node's
    metrics on that port (each pod sets ``PROMETHEUS_MULTIPROC_DIR``).
    """
    cluster, router = configs_from_args(args)
    controller = (
        ray.remote(ClusterController)
        .options(
            name=f"{cluster.name}-controller", lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=16,
        )
        .remote(cluster, metrics_port=args.get("metrics_port"))
    )
    ray.get(controller.start.remote(), timeout=READY_TIMEOUT_S)
    return Router.bind(controller, router)
