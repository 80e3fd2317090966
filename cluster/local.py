"""Tandem on this machine, from this process: ``tandem up`` and every benchmark that
launches the service start it here, the one way.

``local_ray`` gives the process a metrics folder and a Ray: the one ``RAY_ADDRESS``
names, one this process already runs, or a new local one (``num_cpus``, no dashboard).
``local_service`` starts the whole service in it (``TandemService``). Leaving either
undoes what it did, in reverse: the service shuts down, the Ray it started stops, the
metrics folder goes.

Every process of the service (workers, router replicas, the controller) writes its
metrics into the folder (``cluster.metrics_server``), which the Ray it starts hands to
its processes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.service import ServiceConfig, TandemService


@contextlib.contextmanager
def local_ray(
    num_cpus: int | None = None, *, metrics_kind: str = "", log_to_driver: bool = True, env: dict | None = None
) -> Iterator[str]:
    """Ray for this process, with a fresh metrics folder (its path is what this yields).
    ``metrics_kind`` names the folder (``$TANDEM_HOME/metrics/[kind-]pid``); ``env``: more
    environment for the Ray it starts."""
    from cluster.metrics_server import ENV, process_metrics_dir, remove_metrics_dir

    metrics_dir = process_metrics_dir(metrics_kind)
    import ray

    own_ray = not ray.is_initialized()
    try:
        if own_ray:
            local = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": num_cpus, "include_dashboard": False}
            ray.init(logging_level="WARNING", log_to_driver=log_to_driver,
                     runtime_env={"env_vars": {ENV: metrics_dir, **(env or {})}}, **local)
        yield metrics_dir
    finally:
        if own_ray:
            ray.shutdown()
        remove_metrics_dir(metrics_dir)


@contextlib.contextmanager
def local_service(config: ServiceConfig, num_cpus: int | None = None, **ray_options) -> Iterator[TandemService]:
    """The whole service, started in ``local_ray(num_cpus, **ray_options)``; shut down on leaving."""
    from cluster.service import TandemService

    with local_ray(num_cpus, **ray_options):
        service = TandemService(config).start()
        try:
            yield service
        finally:
            service.shutdown()
