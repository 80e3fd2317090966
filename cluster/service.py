"""The whole service on a Ray cluster: worker pools, their controller, and the router.

``TandemService(config, ...).start()`` starts the controller actor (which starts the
pools), Serve's HTTP and gRPC proxies, and the router application; ``shutdown()``
takes them down in reverse order. ``tandem up`` and the integration tests use it;
the caller owns ``ray.init`` / ``ray.shutdown``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from cluster.config import ClusterConfig
from cluster.controller import ClusterController
from router.server import GRPC_SERVICERS, Router, RouterConfig

READY_TIMEOUT_S = 300.0


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
