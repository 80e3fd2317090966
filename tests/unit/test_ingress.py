"""Choosing Serve's ingress: the setting, the environment it becomes, the flags and files."""

from __future__ import annotations

import os

import pytest

from cluster import flags
from cluster.ingress import (
    ENABLE_HAPROXY,
    FALLBACK_GRPC_PORT,
    FALLBACK_HTTP_PORT,
    GRPC_MAX_MESSAGE,
    MIN_DRAIN_S,
    THREADS,
    check_environment,
    describe,
    haproxy_threads,
    ingress_from_env,
    serve_env,
)
from cluster.service import ServiceConfig, controller_env
from router.core import RouterConfig
from tandem.cli import build_parser


def test_haproxy_is_the_default_and_other_names_are_refused_naming_the_field():
    assert ServiceConfig().ingress == "haproxy"
    assert ServiceConfig(ingress="proxy").ingress == "proxy"
    with pytest.raises(ValueError, match="ingress must be one of haproxy, proxy; got 'nginx'"):
        ServiceConfig(ingress="nginx")


def test_serve_env_turns_haproxy_on_or_explicitly_off():
    assert serve_env("haproxy") == {ENABLE_HAPROXY: "1"}
    # off explicitly: a RAY_SERVE_ENABLE_HA_PROXY=1 inherited from the shell must not win
    assert serve_env("proxy") == {ENABLE_HAPROXY: "0"}
    env = serve_env("haproxy", fallback_ports=(41000, 41001), drain_s=2.0)
    assert env == {ENABLE_HAPROXY: "1", FALLBACK_HTTP_PORT: "41000", FALLBACK_GRPC_PORT: "41001", MIN_DRAIN_S: "2"}


def test_haproxy_gets_a_thread_per_four_cpus_from_one_to_four():
    assert [haproxy_threads(n) for n in (1, 2, 4, 7, 8, 16, 96)] == [1, 1, 1, 1, 2, 4, 4]
    assert serve_env("haproxy", threads=2)[THREADS] == "2"
    assert THREADS not in serve_env("proxy") and THREADS not in serve_env("haproxy")


def test_the_controller_env_picks_free_backup_ports_on_the_head_and_keeps_exported_values():
    env = controller_env(ServiceConfig(), on_head=True, environ={})
    assert env[ENABLE_HAPROXY] == "1" and env[MIN_DRAIN_S] == "2"
    assert int(env[FALLBACK_HTTP_PORT]) != int(env[FALLBACK_GRPC_PORT]), env
    assert env[THREADS] == str(haproxy_threads(os.cpu_count() or 1)), env
    remote = controller_env(ServiceConfig(), on_head=False, environ={})
    assert FALLBACK_HTTP_PORT not in remote, "off the head this process cannot tell which ports are free"
    assert THREADS not in remote, "off the head this process cannot tell the head's CPUs"
    exported = {MIN_DRAIN_S: "30", FALLBACK_HTTP_PORT: "8500", ENABLE_HAPROXY: "0", THREADS: "3"}
    env = controller_env(ServiceConfig(), on_head=True, environ=exported)
    assert (env[MIN_DRAIN_S], env[FALLBACK_HTTP_PORT], env[ENABLE_HAPROXY], env[THREADS]) == ("30", "8500", "1", "3")
    proxy = controller_env(ServiceConfig(ingress="proxy"), on_head=True, environ={})
    assert proxy == {ENABLE_HAPROXY: "0", GRPC_MAX_MESSAGE: str(RouterConfig().max_body_bytes)}


def test_serves_grpc_message_limit_is_the_body_limit_on_either_ingress_unless_exported():
    for ingress in ("haproxy", "proxy"):
        env = controller_env(ServiceConfig(ingress=ingress), on_head=False, environ={})
        assert env[GRPC_MAX_MESSAGE] == str(RouterConfig().max_body_bytes), (ingress, env)
        exported = controller_env(ServiceConfig(ingress=ingress), on_head=False, environ={GRPC_MAX_MESSAGE: "9"})
        assert exported[GRPC_MAX_MESSAGE] == "9", "an operator's value wins (responses are held to it too)"
    with pytest.raises(ValueError, match="grpc_max_message_bytes must be >= 1, got 0"):
        ServiceConfig(grpc_max_message_bytes=0)


def test_an_application_asking_for_another_ingress_than_the_pods_run_fails_clearly():
    check_environment(None, {})
    check_environment("haproxy", {ENABLE_HAPROXY: "1"})
    check_environment("proxy", {})
    with pytest.raises(ValueError, match="asks for 'haproxy', but this Ray cluster runs 'proxy'"):
        check_environment("haproxy", {ENABLE_HAPROXY: "0"})
    assert ingress_from_env({ENABLE_HAPROXY: "true"}) == "proxy", "Serve turns it on for '1' only"


def test_operators_are_told_haproxys_other_ports():
    assert describe("haproxy", {}) == "HAProxy (stats page :8404, Prometheus exporter :9101, on all interfaces)"
    assert ":9999" in describe("haproxy", {"RAY_SERVE_HAPROXY_STATS_PORT": "9999"})
    assert describe("proxy", {}) == "Serve's Python proxy"


def _up(*argv):
    return build_parser().parse_args(["up", *argv])


def test_the_flag_or_the_topology_file_chooses_the_ingress(tmp_path):
    assert flags.ingress(_up()) == "haproxy"
    assert flags.ingress(_up("--ingress", "proxy")) == "proxy"
    path = tmp_path / "topology.yaml"
    path.write_text("ingress: proxy\nprefill_workers: 2\n")
    assert flags.ingress(_up("--config", str(path))) == "proxy"
    assert flags.ingress(_up("--config", str(path), "--ingress", "haproxy")) == "haproxy", "the flag overrides the file"
    assert flags.cluster_config(_up("--config", str(path))).prefill_workers == 2, "ingress is no pool setting"
    path.write_text("ingress: nginx\n")
    with pytest.raises(ValueError, match="ingress must be one of"):
        flags.ingress(_up("--config", str(path)))
    with pytest.raises(SystemExit):
        _up("--ingress", "nginx")


def test_ports_chosen_for_later_are_distinct_free_and_below_the_ephemeral_range():
    from cluster.service import SPARE_PORTS, free_ports

    avoid = set(range(20000, 29990))
    ports = free_ports("127.0.0.1", 3, avoid=avoid)
    assert len(set(ports)) == 3 and all(p in SPARE_PORTS and p not in avoid for p in ports), ports



def test_serves_grpc_servers_refuse_a_message_over_the_limit_unread_and_keep_serving():
    """Ray's own gRPC server, built in a process with the controller's environment as
    Serve's proxy and replicas build theirs: a Generate message over the limit is
    refused by grpc (RESOURCE_EXHAUSTED naming the limit) before any handler sees it,
    and the next call is answered. Serve's default would take it (up to 2 GiB)."""
    import inspect
    import json
    import subprocess
    import sys

    from cluster.service import free_ports
    from router.server import GRPC_SERVICERS

    limit = 64 * 1024
    env = {**os.environ, **controller_env(ServiceConfig(grpc_max_message_bytes=limit), on_head=False, environ={})}
    # The child runs the function's source: importing this module would load torch (1 s).
    args = (limit, free_ports("127.0.0.1", 1)[0], GRPC_SERVICERS)
    child = f"{inspect.getsource(_oversized_call)}\nprint(json.dumps(_oversized_call(*{args!r})))"
    out = subprocess.run([sys.executable, "-c", "import json\n" + child], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["code"] == "RESOURCE_EXHAUSTED" and str(limit) in got["details"], got
    assert got["handled"] == ["/grpc.health.v1.Health/Check"], f"only the health check may reach a handler: {got}"
    assert got["health"] == "SERVING", got


def _oversized_call(limit: int, port: int, servicers: list[str]) -> dict:
    """(Run in a child.) Serve's gRPC server on ``port`` with ``servicers`` and a handler
    that records each call; what a Generate message over ``limit`` and then a Check got."""
    import asyncio

    import grpc
    from ray.serve._private.grpc_util import start_grpc_server
    from ray.serve.config import gRPCOptions

    from protos.grpc.health.v1 import health_pb2
    from protos.tandem.v1 import generate_pb2 as pb

    handled: list[str] = []
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()

    def handler_factory(service_method: str, streaming_type):
        async def handle(request, context):
            handled.append(service_method)
            return serving
        return handle

    async def calls() -> dict:
        options = gRPCOptions(port=port, grpc_servicer_functions=servicers)
        _, server = await start_grpc_server(handler_factory, options, event_loop=asyncio.get_running_loop())
        big = pb.GenerateRequest(text="y" * limit).SerializeToString()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                [m async for m in channel.unary_stream("/tandem.v1.Generation/Generate")(big, timeout=10)]
                code, details = "OK", ""
            except grpc.aio.AioRpcError as e:
                code, details = e.code().name, e.details()
            raw = await channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)
        await server.stop(None)
        status = health_pb2.HealthCheckResponse.FromString(raw).status
        return {"code": code, "details": details, "handled": handled,
                "health": health_pb2.HealthCheckResponse.ServingStatus.Name(status)}

    return asyncio.run(calls())
