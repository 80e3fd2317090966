"""The whole service on a Ray cluster: worker pools, their controller, and the router.

``TandemService(config, ...).start()`` starts the controller actor (which starts the
pools), Serve with its ingress (HAProxy by default, or Serve's Python proxy: see
``cluster/ingress.py``) on the HTTP and gRPC ports, and the router application;
``shutdown()`` takes them down in reverse order. A Serve already running in the Ray
cluster is used as it is (its ports, ingress and gRPC message limit), and
``shutdown(keep_serve=True)`` leaves it up: the integration tests start one service
after another on one Serve.
``tandem up`` and the tests use it; the caller owns ``ray.init`` / ``ray.shutdown``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import random
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError

from cluster import flags
from cluster.config import ClusterConfig
from cluster.controller import ClusterController, controller_name, retire_other_controllers
from cluster.ingress import (
    DEFAULT_INGRESS,
    ENABLE_HAPROXY,
    HAPROXY_SIDE_PORTS,
    LOCAL_DRAIN_S,
    check_environment,
    check_ingress,
    haproxy_threads,
    serve_env,
)
from cluster.pools import StartTimeout
from router.admission import AdmissionConfig
from router.api_config import ApiConfig
from router.dispatch import DispatchConfig
from router.server import GRPC_SERVICERS, Router, RouterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceConfig:
    """Everything a ``TandemService`` starts: the pools' topology, the router's settings, where
    Serve listens (host, HTTP and gRPC ports, ingress), its gRPC message limit and the app's
    name. Built once, from the flags (``from_flags``) or by the caller."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    host: str = "127.0.0.1"
    http_port: int = flags.HTTP_PORT
    grpc_port: int = flags.GRPC_PORT
    app_name: str = "tandem"
    ingress: str = DEFAULT_INGRESS  # "haproxy" or "proxy": Serve's Python proxy (cluster/ingress.py)
    # A Ray custom resource only the head node advertises: the controller and the router
    # ask for a unit of it, so they run on the head (see ``head_pinned``). None: no pin.
    head_resource: str | None = None
    # The largest gRPC message Serve's servers take or send (grpc refuses a larger one
    # unread: RESOURCE_EXHAUSTED). Serve-wide, unlike the router's per-app body limit,
    # which the router still checks. Serve holds responses to it too: a first message
    # with prompt_logprobs of a long prompt can pass it (docs/SECURITY.md).
    grpc_max_message_bytes: int = RouterConfig.max_body_bytes

    def __post_init__(self) -> None:
        check_ingress(self.ingress)
        if self.grpc_max_message_bytes < 1:
            raise ValueError(f"grpc_max_message_bytes must be >= 1, got {self.grpc_max_message_bytes}")

    @classmethod
    def from_flags(cls, args: argparse.Namespace, *, free: bool = False, api_key: str | None = None) -> ServiceConfig:
        """The service that ``cluster/flags.py``'s flags describe. ``free``: on ports
        free now (benchmarks), instead of ``--host``, ``--http-port`` and ``--grpc-port``."""
        router = router_config(flags.router_settings(args, tuple(ROUTER_SETTINGS)), api_key=api_key)
        host = cls.host if free else args.host
        ports = free_ports(host, 2) if free else (args.http_port, args.grpc_port)
        return cls(
            cluster=flags.cluster_config(args),
            router=router,
            host=host,
            http_port=ports[0],
            grpc_port=ports[1],
            ingress=flags.ingress(args),
        )


# The router's settings by the names the flags and the chart's ``serve`` values give them
# (``--max-outstanding-requests``, ``maxOutstandingRequests``): where each lives in ``RouterConfig``.
ROUTER_SETTINGS = {
    "max_outstanding_requests": ("admission", "max_requests"),
    "max_outstanding_prompt_tokens": ("admission", "max_prompt_tokens"),
    "placement": ("dispatch", "placement"),
    "local_prefill_tokens": ("dispatch", "local_prefill_tokens"),
    "local_prefill_backlog_tokens": ("dispatch", "local_prefill_backlog_tokens"),
    "reasoning_parser": ("api", "reasoning_parser"),
    "max_stored_responses": ("api", "max_stored_responses"),
}


def router_config(settings: dict, api_key: str | None = None) -> RouterConfig:
    """A ``RouterConfig`` from ``settings`` named as in ``ROUTER_SETTINGS`` (other keys are
    ignored); a setting absent or None keeps its default."""
    parts: dict[str, dict] = {"admission": {}, "dispatch": {}, "api": {}}
    for name, (part, field_name) in ROUTER_SETTINGS.items():
        if settings.get(name) is not None:
            parts[part][field_name] = settings[name]
    return RouterConfig(admission=AdmissionConfig(**parts["admission"]), dispatch=DispatchConfig(**parts["dispatch"]),
                        api=ApiConfig(**parts["api"]), api_key=api_key)


# Ports chosen now and bound later come from below the kernel's ephemeral range
# (32768+ on Linux), where an outgoing connection could take one in the meantime, and
# above Ray's worker ports (10002-19999); Serve's replicas bind from 30000.
SPARE_PORTS = range(20000, 30000)


def free_ports(host: str, n: int, avoid: Iterable[int] = ()) -> list[int]:
    """``n`` distinct ports of ``SPARE_PORTS`` free now on ``host``, none in ``avoid``."""
    avoid = set(avoid)
    with contextlib.ExitStack() as stack:  # hold each until all are chosen: distinct
        ports: list[int] = []
        for port in random.sample(SPARE_PORTS, len(SPARE_PORTS)):
            if port in avoid:
                continue
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((host if host != "0.0.0.0" else "", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"fewer than {n} free ports in {SPARE_PORTS} on {host}")


# Units of the head's custom resource each pinned actor asks for (the chart's head
# advertises 1000: room for the controller and many router replicas).
HEAD_RESOURCE_UNITS = 1


def head_pinned(head_resource: str | None) -> dict:
    """Ray actor options that keep an actor on the head node: a unit of ``head_resource``,
    a custom resource only the head advertises (the Helm chart's ``head.pinResource``).
    None or "" (``tandem up``, a cluster without it): no resource asked for, so the actor
    schedules anywhere, as before."""
    return {"resources": {head_resource: HEAD_RESOURCE_UNITS}} if head_resource else {}


def router_deployment(head_resource: str | None = None):
    """The router's Serve deployment, pinned to the head when ``head_resource`` is set
    (its other actor options, ``num_cpus`` and ``runtime_env``, kept)."""
    if not head_resource:
        return Router
    options = dict(Router.ray_actor_options or {})
    options["resources"] = {**(options.get("resources") or {}), **head_pinned(head_resource)["resources"]}
    return Router.options(ray_actor_options=options)


def _on_head_node() -> bool:
    """Whether this driver runs on the Ray head node (where Serve's proxies start)."""
    me = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == me and "node:__internal_head__" in n["Resources"] for n in ray.nodes() if n["Alive"])


def controller_env(config: ServiceConfig, on_head: bool, environ) -> dict[str, str]:
    """The environment of Serve's controller (and so of its proxies and replicas).

    Serve's gRPC servers take messages up to ``config.grpc_max_message_bytes``, either
    ingress. On the head node (where the driver can see which ports are free), HAProxy's
    backup proxy gets free ports rather than Serve's fixed 8500 / 9500, so that two
    services on one machine (tests, a second ``tandem up``) do not collide, and HAProxy as
    many threads as the node's CPUs warrant (``haproxy_threads``). Values in ``environ``
    (this process's environment) win over the defaults chosen here.
    """
    if config.ingress == "proxy":
        env = serve_env("proxy", grpc_max_message_bytes=config.grpc_max_message_bytes)
    else:
        env = _haproxy_env(config, on_head)
    env.update({k: environ[k] for k in env if k != ENABLE_HAPROXY and k in environ})
    return env


def _haproxy_env(config: ServiceConfig, on_head: bool) -> dict[str, str]:
    ports = tuple(free_ports(config.host, 2, avoid={config.http_port, config.grpc_port})) if on_head else None
    threads = haproxy_threads(os.cpu_count() or 1) if on_head else None
    env = serve_env("haproxy", fallback_ports=ports, drain_s=LOCAL_DRAIN_S, threads=threads,
                    grpc_max_message_bytes=config.grpc_max_message_bytes)
    if on_head:
        # HAProxy's stats page and exporter: their usual ports when free, else spare ones
        # (a second service on the machine would otherwise stop HAProxy from starting).
        taken = {config.http_port, config.grpc_port, *(ports or ())}
        for var, default in HAPROXY_SIDE_PORTS.values():
            port = default if _port_free(default) and default not in taken else free_ports("0.0.0.0", 1, taken)[0]
            env[var] = str(port)
            taken.add(port)
    return env


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


class TandemService:
    """One whole service on a Ray cluster (the module docstring says what it starts): ``start``
    brings up the controller, its pools and the router app, ``shutdown`` takes them down in
    reverse order. The caller owns ``ray.init`` and ``ray.shutdown``."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.controller = None
        self.model_info: dict | None = None
        self.serve_env: dict[str, str] = {}  # what Serve's controller and proxies run with

    def start(self) -> TandemService:
        from ray import serve
        from ray.serve.config import gRPCOptions

        cfg = self.config
        self.controller = (
            ray.remote(ClusterController)
            .options(
                name=controller_name(cfg.cluster), num_cpus=0, max_concurrency=16,
                **head_pinned(cfg.head_resource),
            )
            .remote(cfg.cluster)
        )
        try:
            # The router's replica starts while the pools do (it waits for their start
            # itself): the two take the same time, and a start is mostly one core's work.
            started = self.controller.start.remote()
            self.serve_env = controller_env(cfg, _on_head_node(), os.environ)
            serve.start(
                http_options={"host": cfg.host, "port": cfg.http_port},
                grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=GRPC_SERVICERS),
                controller_options={"runtime_env": {"env_vars": self.serve_env}},
            )
            try:
                serve.run(
                    router_deployment(cfg.head_resource).bind(self.controller, cfg.router),
                    name=cfg.app_name, route_prefix="/",
                )
            finally:  # the pools' own error, if they failed, says more than Serve's
                self.model_info = wait_started(self.controller, cfg.cluster, started)
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

    def shutdown(self, keep_serve: bool = False) -> None:
        """Stop the service: Serve and then the controller with its worker pools. With
        ``keep_serve``, only this service's application goes, and Serve's controller and
        ingress stay up for the next service started in this Ray (``start`` finds them)."""
        from ray import serve

        try:
            if keep_serve:
                serve.delete(self.config.app_name)
            else:
                serve.shutdown()
                wait_for_serve_actors_gone()
        finally:
            if self.controller is not None:
                try:
                    ray.get(self.controller.shutdown.remote(), timeout=60)
                finally:
                    ray.kill(self.controller)
                    self.controller = None


def wait_for_serve_actors_gone(timeout_s: float = 60.0) -> None:
    """``serve.shutdown`` may return (its own wait timed out on a busy machine) while the
    old controller still winds down; finishing later, it kills Serve's proxy actors by
    name, those of a Serve started meanwhile included. Wait until none is left."""
    deadline = time.monotonic() + timeout_s
    while any(a["namespace"] == "serve" for a in ray.util.list_named_actors(all_namespaces=True)):
        if time.monotonic() > deadline:
            log.warning("Serve's actors were still there %.0f s after serve.shutdown()", timeout_s)
            return
        time.sleep(0.2)


def configs_from_args(args: dict) -> tuple[ClusterConfig, RouterConfig]:
    """The deployment a RayService's ``serveConfigV2`` application args describe.

    ``args``: ``topology`` (the keys of a ``tandem up --config`` file),
    ``worker_resources`` (custom Ray resources per role, pinning each pool to its
    worker group), ``start_timeout_s`` (how long the pools may take to start; apart
    from ``topology``, which the chart hashes into the pods' annotations) and ``router``
    (admission bounds, placement and its per-request disaggregation, the reasoning parser and the stored
    responses' bound, and ``api_key_env``: the environment variable holding the API key, so the key never sits
    in the config).
    """
    topology = dict(args.get("topology") or {})
    if args.get("start_timeout_s") is not None:
        topology["start_timeout_s"] = args["start_timeout_s"]
    for role, custom in (args.get("worker_resources") or {}).items():
        key = f"{role}_resources"
        resources = dict(topology.get(key) or {})
        resources["custom"] = {**resources.get("custom", {}), **custom}
        topology[key] = resources
    r = dict(args.get("router") or {})
    key_env = r.pop("api_key_env", None)
    unknown = set(r) - set(ROUTER_SETTINGS)
    if unknown:
        raise ValueError(f"unknown router settings: {sorted(unknown)} (known: {sorted(ROUTER_SETTINGS)}, api_key_env)")
    router = router_config(r, api_key=os.environ.get(key_env) if key_env else None)
    return ClusterConfig.from_dict(topology), router


def app(args: dict):
    """Serve application builder for a RayService (``serveConfigV2`` in ``deploy/helm``).

    The controller is a named detached actor, so a redeploy with the same settings finds
    the pools it started still running; Serve may build the application again while a
    start is still waiting for resources, and that build waits for the same start. Its
    name carries a hash of the settings (``controller_name``): changed settings get a new
    controller, and the old ones are stopped first, so their pools free what the new
    ones need. ``start_timeout_s`` in ``args`` bounds each start (a running controller
    takes a changed one too); a start past it is retried (``start_retrying``; at most
    ``start_attempts`` starts when ``args`` says).
    With ``metrics_port`` in ``args`` it serves every node's metrics on that port (each pod
    sets ``PROMETHEUS_MULTIPROC_DIR``). ``ingress`` in ``args`` must be the one the pods'
    environment runs (cluster/ingress.py). With ``head_resource`` (a custom resource only
    the head advertises) the controller and the router replicas ask for a unit of it, so
    they run on the head, not on a worker pod that the autoscaler may remove.
    """
    check_environment(args.get("ingress"), os.environ)
    cluster, router = configs_from_args(args)
    head_resource, metrics_port = args.get("head_resource"), args.get("metrics_port")
    name = controller_name(cluster, metrics_port)
    retire_other_controllers(keep=name)
    controller = (
        ray.remote(ClusterController)
        .options(
            name=name, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=16, **head_pinned(head_resource),
        )
        .remote(cluster, metrics_port=metrics_port)
    )
    start_retrying(lambda: wait_started(controller, cluster), args.get("start_attempts"))
    return router_deployment(head_resource).bind(controller, router)


START_BACKOFF_S = (10.0, 300.0)  # the wait before a start's first retry, and the most it grows to


def start_retrying(start, attempts: int | None = None, sleep=time.sleep) -> dict:
    """``start()``'s result, trying again after a ``StartTimeout`` (the cluster lacked
    the pools' resources in time: GPUs not there yet, pods still scheduling) with a
    backoff from 10 s doubling to 5 min, up to ``attempts`` starts in all (None: until one
    succeeds). KubeRay submits an application once per config, so a build that gave up
    would leave the service failed until the config changed; each failed start has
    removed its placement groups and actors. Any other error is raised at once: a start
    that fails for a reason the cluster cannot outgrow fails the application."""
    wait, most = START_BACKOFF_S
    for attempt in itertools.count(1):
        try:
            return start()
        except StartTimeout as e:
            if attempts is not None and attempt >= attempts:
                raise
            log.warning("start attempt %d timed out (%s); trying again in %.0f s", attempt, e, wait)
            sleep(wait)
            wait = min(most, 2 * wait)


# The controller enforces start_timeout_s itself; this margin only keeps a caller from
# waiting forever on a controller that stopped answering.
START_WAIT_MARGIN_S = 60.0


def wait_started(controller, cluster: ClusterConfig, started=None) -> dict:
    """What the controller's ``start()`` returns (its error, if the start failed);
    ``started``: the reference of a ``start`` call already made."""
    limit = cluster.start_timeout_s + START_WAIT_MARGIN_S
    try:
        return ray.get(started or controller.start.remote(cluster.start_timeout_s), timeout=limit)
    except GetTimeoutError:
        raise TimeoutError(f"the cluster controller's start did not return within {limit:g} s") from None
