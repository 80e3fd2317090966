"""A real Prometheus scrapes the service; every dashboard query and alert rule returns data.

The load is shaped so that every series the dashboard plots exists: a small KV pool
forces preemptions (and, with a host tier behind it, spills and restores as the waves
resend their prompts), injected transfer drops make failures (recomputed, so requests
still finish), and bursts past a small admission bound make rejections.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import (
    ON_CI,
    PATIENCE_S,
    PROMETHEUS_SOURCE,
    assert_blocks_freed,
    free_port,
    require_tool,
    running_service,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tandem-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
THRESHOLD = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*[0-9.eE+-]+\s*$")

if not ON_CI:  # skip before the fixtures start Ray; under CI=true the fixture fails instead
    require_tool("prometheus", PROMETHEUS_SOURCE, allow_module_level=True)


def dashboard_queries() -> list[str]:
    """Every panel target's expression, with the template variables set to "All"."""
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str) and "targets" not in node:
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return [e.replace("$model", ".*").replace("$role", ".*") for e in exprs]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def prometheus(ray_cluster, tmp_path_factory):
    """The node's scrape endpoint, and a Prometheus scraping it every second."""
    require_tool("prometheus", PROMETHEUS_SOURCE)
    from cluster.metrics_server import start_metrics_server

    metrics_port, web_port = free_port(), free_port()
    endpoint = start_metrics_server(metrics_port)
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "tandem", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{web_port}"

    def ready() -> bool:
        assert proc.poll() is None, "prometheus exited at start-up"
        try:
            return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, PATIENCE_S, "prometheus to answer /-/ready", every_s=0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        endpoint.shutdown()


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


async def _load(http_url: str, model: str, n: int, max_tokens: int) -> list[int]:
    """``n`` concurrent streaming completions; returns their HTTP statuses."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": model, "prompt": f"load {i} " * 8, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        async with client.stream("POST", f"{http_url}/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def test_every_dashboard_query_and_alert_rule_returns_data(prometheus, tiny_model):
    from router.admission import AdmissionConfig
    from router.server import RouterConfig

    model = tiny_model.rstrip("/").split("/")[-1]
    router = RouterConfig(admission=AdmissionConfig(max_requests=6))
    transfer = {"backend": "object_store", "faults": {"drop_rate": 0.3, "seed": 1}}
    engine = {"num_kv_blocks": 24, "host_kv_cache_memory": 1 << 20}  # the tier's panel divides by its size
    with running_service(tiny_model, router, transfer=transfer, engine=engine) as svc:
        statuses = []
        for _ in range(3):  # waves, so every counter rises across several scrapes
            statuses += asyncio.run(_load(svc.http_url, model, n=10, max_tokens=48))
            time.sleep(1.5)
        assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
        assert_blocks_freed(svc)

        assert query(prometheus, 'up{job="tandem"}')[0]["value"][1] == "1"
        exprs = dashboard_queries()
        assert len(exprs) >= 20
        rules = alert_rules()
        assert {r["alert"] for r in rules} >= {
            "TandemHighTTFTP99", "TandemKVTransferFailures", "TandemKVCacheNearlyFull", "TandemRequestsRejected"
        }
        bare = {r["alert"]: THRESHOLD.sub("", r["expr"]) for r in rules}
        for rule in rules:
            assert bare[rule["alert"]] != rule["expr"], f"{rule['alert']}: expr should end in one threshold comparison"
        gaps: dict = {}

        def complete() -> bool:
            """Every query and alert expression has data, every rule evaluated ok (else ``gaps``)."""
            groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
            health = {r["name"]: (r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]}
            gaps.update({
                "dashboard queries without data": [e for e in exprs if not _has_value(query(prometheus, e))],
                "alert expressions without data": [a for a, e in bare.items() if not _has_value(query(prometheus, e))],
                "alert rules not evaluated ok": {
                    r["alert"]: health.get(r["alert"], "not loaded") for r in rules if health.get(r["alert"]) != ("ok", "")
                },
            })
            return not any(gaps.values())

        # Prometheus scrapes and evaluates on its own clock (every second): poll until it
        # has seen the final state, rather than sleeping for a few scrapes.
        wait_for(complete, PATIENCE_S, lambda: f"every dashboard query and alert rule to have data: {gaps}", every_s=1.0)


def _has_value(result: list[dict]) -> bool:
    """At least one series with a number (histogram_quantile over no traffic gives NaN)."""
    return any(not math.isnan(float(s["value"][1])) for s in result)
