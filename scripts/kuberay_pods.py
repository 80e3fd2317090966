"""Runs the Helm chart's RayService the way KubeRay runs it, on one machine, with no
Kubernetes: a pod per Ray node (the head and each worker group's replicas), each a buildah
container of the image in a network namespace of its own, on a bridge, as pods are on a
cluster network. Used by scripts/image-check.

The pods are those KubeRay's operator would make of the chart rendered by Helm's own code
(``kuberay_render.py``, beside this file: each pod's ``ray start`` command, environment,
volumes, user and ``wait-gcs-ready`` init container); they run on ``kuberay_machine.py``'s
network namespaces and buildah containers. This file is the run: as the RayService
controller does, the rendered ``serveConfigV2`` goes to the head's dashboard
(``PUT /api/serve/applications/`` with Ray's auth token) once the head is up, while the
workers join.

The check then waits for the application to be RUNNING, asks a chat question through the
head's HTTP port (HAProxy, when the chart runs Serve's HAProxy ingress), scrapes every
pod's metrics ports, checks KubeRay's probes and the uid of the serving processes, and
tears it all down. Needs root (network namespaces, buildah with chroot isolation).

    python scripts/kuberay_pods.py --image localhost/tandem:cpu --storage DIR --work DIR
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import shlex
import signal
import string
import sys
import time
from pathlib import Path

# The modules beside this one, where a test loads it by its path (``python scripts/kuberay_pods.py``
# finds them itself): the rendered chart's pods, and the machine that runs them.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kuberay_machine import ClusterDNS, Machine, http, listener_uid
from kuberay_render import (
    DEFAULT_AGENT_LISTEN_PORT,
    DEFAULT_DASHBOARD_PORT,
    DEFAULT_METRICS_PORT,
    DOMAIN,
    CheckFailed,
    Cluster,
    Pod,
    build_cluster,
    convert_param_map,
    ray_start_command,
    render,
)

__all__ = ["CheckFailed", "ClusterDNS", "build_cluster", "check_values", "convert_param_map", "main",
           "ray_start_command", "render", "run_check"]


def log(msg: str) -> None:
    """A line of the check's progress, as image-check prints its own."""
    print(f"image-check: {msg}", flush=True)


# ------------------------------------------------------------------------------ the run


def _wait(what: str, timeout: float, probe, pods: list[Pod], every: float = 3.0):
    start = time.time()
    while True:
        result = probe()
        if result:
            log(f"{what} after {time.time() - start:.0f} s")
            return result
        for pod in pods:
            if pod.process and pod.process.poll() is not None:
                tail = pod.log_path.read_text()[-3000:] if pod.log_path else ""
                raise CheckFailed(f"{what}: pod {pod.name} exited ({pod.process.returncode}); its log ends:\n{tail}")
        if time.time() - start > timeout:
            raise CheckFailed(f"{what}: not after {timeout:.0f} s")
        time.sleep(every)


def _metric_total(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _create_pods(c: Cluster, m: Machine, namespace: str, domain: str) -> None:
    """The pods' network, the cluster DNS for the head Service's name, and their containers."""
    head = c.pods[0]
    for pod in c.pods:
        log(f"pod {pod.name} ({pod.group}) at {pod.ip}, netns {pod.netns}: {shlex.join(pod.command)}")
    m.network(c.pods)
    m.dns = ClusterDNS(f"{m.subnet}.1", {c.fqdn: head.ip})
    for pod in c.pods:
        m.create(pod, namespace, domain)


def _wait_head_ready(head: Pod, dashboard: str) -> None:
    """KubeRay's head probes (Ray >= 2.53: GET /api/healthz on the agent's port; the older
    exec probe's gcs_healthz too), sent as the kubelet sends them: no token."""
    def head_ready():
        return (http(f"http://{head.ip}:{DEFAULT_AGENT_LISTEN_PORT}/api/healthz")[0] == 200
                and http(f"{dashboard}/api/gcs_healthz")[0] == 200)

    _wait("the head is Ready (KubeRay's probes)", 300, head_ready, [head])


def _put_serve_config(c: Cluster, dashboard: str) -> None:
    """The RayService controller: the Serve config to the dashboard, with the operator's token
    (and, where there is one, refused without it)."""
    if c.token:
        code, text = http(f"{dashboard}/api/serve/applications/", method="PUT", body=c.serve_config, timeout=60)
        if code not in (401, 403):
            raise CheckFailed(f"PUT without Ray's token answered {code}, not 401/403: the dashboard is open "
                              f"({text[:200]})")
        log(f"PUT /api/serve/applications/ without the token: {code} (refused, as it must be)")
    code, text = http(f"{dashboard}/api/serve/applications/", method="PUT", body=c.serve_config,
                      token=c.token, timeout=120)
    if code != 200:
        raise CheckFailed(f"PUT /api/serve/applications/: {code} {text[:1000]}")
    log("PUT /api/serve/applications/ (the rendered serveConfigV2, with Ray's token): 200")


def _start_workers(m: Machine, workers: list[Pod]) -> None:
    """Workers: KubeRay's wait-gcs-ready init container, then the Ray container."""
    for pod in workers:
        t = time.time()
        out = m.exec(pod, pod.init_command, timeout=180)
        if out.returncode != 0:
            raise CheckFailed(f"{pod.name}: wait-gcs-ready failed: {(out.stdout + out.stderr)[-1500:]}")
        log(f"{pod.name}: wait-gcs-ready passed in {time.time() - t:.0f} s ({out.stdout.strip().splitlines()[-1]})")
        m.start(pod)


def _wait_app_running(c: Cluster, dashboard: str, timeout: float) -> None:
    """The application RUNNING, as the dashboard reports it; DEPLOY_FAILED or UNHEALTHY fails."""
    def app_state():
        code, text = http(f"{dashboard}/api/serve/applications/", token=c.token, timeout=20)
        if code != 200:
            return None
        app = (json.loads(text).get("applications") or {}).get(c.app_name) or {}
        if app.get("status") in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise CheckFailed(f"application {c.app_name}: {app.get('status')}: {app.get('message', '')[:2000]}")
        return app if app.get("status") == "RUNNING" else None

    _wait(f"application {c.app_name} RUNNING", timeout, app_state, c.pods, every=5)


def _check_probes(c: Cluster, head: Pod, workers: list[Pod]) -> None:
    """Readiness: every worker's raylet through the agent (KubeRay's probe); the head's Serve
    proxy (the controller labels the head serve=true); workers must not be Ready for the
    chart's readinessProbe (/-/healthz on the serve port), or the HTTP Service would send
    clients where nothing serves."""
    for pod in workers:
        code, _ = http(f"http://{pod.ip}:{DEFAULT_AGENT_LISTEN_PORT}/api/healthz")
        if code != 200:
            raise CheckFailed(f"{pod.name}: KubeRay's liveness probe (agent /api/healthz) answered {code}")
    code, text = http(f"http://{head.ip}:{c.http_port}/-/healthz")
    if code != 200:
        raise CheckFailed(f"the head's Serve health (/-/healthz on {c.http_port}) answered {code} {text[:200]}")
    ready_workers = [p.name for p in workers if http(f"http://{p.ip}:{c.http_port}/-/healthz")[0] == 200]
    if ready_workers:
        raise CheckFailed(f"workers answer the serve port's /-/healthz, so they would be HTTP endpoints: "
                          f"{ready_workers}")
    log(f"probes: head serve /-/healthz 200; {len(workers)} worker(s) raylet healthy and not serve-Ready (no proxy)")


def _ask_chat(c: Cluster, m: Machine, head: Pod) -> str:
    """A chat question through the head's HTTP port (HAProxy's when the chart runs it); the reply."""
    base = f"http://{head.ip}:{c.http_port}"
    listener = listener_uid(m, head, c.http_port)
    if listener is None:
        raise CheckFailed(f"nothing listens on the head's port {c.http_port}")
    if c.ingress == "haproxy" and "haproxy" not in listener[2]:
        raise CheckFailed(f"the chart runs the HAProxy ingress, but port {c.http_port} is {listener[2]!r}")
    code, text = http(f"{base}/v1/models", timeout=30)
    if code != 200:
        raise CheckFailed(f"GET /v1/models: {code} {text[:300]}")
    model = json.loads(text)["data"][0]["id"]
    question = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24, "temperature": 0}
    t = time.time()
    code, text = http(f"{base}/v1/chat/completions", method="POST", body=question, timeout=180)
    if code != 200:
        raise CheckFailed(f"POST /v1/chat/completions: {code} {text[:1000]}")
    reply = json.loads(text)
    content: str = reply["choices"][0]["message"]["content"]
    log(f"chat through {c.ingress} on the head's port {c.http_port} ({time.time() - t:.1f} s), model {model}: "
        f"{content!r} (finish_reason {reply['choices'][0].get('finish_reason')}, usage {reply.get('usage')})")
    if not content.strip():
        raise CheckFailed(f"the chat reply is empty: {text[:500]}")
    return content


def _scrape_pod(c: Cluster, pod: Pod) -> dict[str, float]:
    """Tandem's metrics port and Ray's on one pod: their sample counts and Tandem's counters."""
    code, text = http(f"http://{pod.ip}:{c.metrics_port}/metrics", timeout=30)
    tandem = [x for x in text.splitlines() if x.startswith("tandem:")]
    if code != 200 or not tandem:
        raise CheckFailed(f"{pod.name}: GET :{c.metrics_port}/metrics: {code}, {len(tandem)} tandem: samples")
    rcode, rtext = http(f"http://{pod.ip}:{DEFAULT_METRICS_PORT}/metrics", timeout=30)
    ray_lines = [x for x in rtext.splitlines() if x.startswith("ray_")]
    if rcode != 200 or not ray_lines:
        raise CheckFailed(f"{pod.name}: Ray's metrics (:{DEFAULT_METRICS_PORT}): {rcode}, "
                          f"{len(ray_lines)} ray_ samples")
    return {"tandem_samples": len(tandem), "ray_samples": len(ray_lines),
            "request_success_total": _metric_total(text, "tandem:request_success_total"),
            "generation_tokens_total": _metric_total(text, "tandem:generation_tokens_total")}


def _check_scrapes(c: Cluster, head: Pod) -> dict[str, dict[str, float]]:
    """Scrapes: Tandem's port and Ray's on every pod (the metrics Service / PodMonitor
    targets), HAProxy's exporter on the head."""
    scrapes = {}
    time.sleep(6)  # the exporters read the multiprocess files on each scrape; let the counters land
    for pod in c.pods:
        scrapes[pod.name] = _scrape_pod(c, pod)
        log(f"scrape {pod.name} ({pod.group}): {scrapes[pod.name]}")
    head_text = http(f"http://{head.ip}:{c.metrics_port}/metrics", timeout=30)[1]
    for line in head_text.splitlines():
        if line.startswith(("tandem:request_success_total", "tandem:generation_tokens_total")):
            log(f"  head: {line}")
    if _metric_total(head_text, "tandem:request_success_total") < 1:
        raise CheckFailed("the head's scrape counts no successful request (tandem:request_success_total)")
    if c.ingress == "haproxy":
        port = head.ports.get("haproxy-metrics", 9101)
        code, text = http(f"http://{head.ip}:{port}/metrics", timeout=30)
        lines = [x for x in text.splitlines() if x.startswith("haproxy_")]
        if code != 200 or not lines:
            raise CheckFailed(f"HAProxy's exporter (:{port}): {code}, {len(lines)} haproxy_ samples")
        log(f"scrape HAProxy's exporter (head :{port}): {len(lines)} haproxy_ samples")
    return scrapes


def _check_listener_uids(c: Cluster, m: Machine, head: Pod) -> None:
    """The serving processes run as the pod's user (the image's non-root uid)."""
    want = int(head.user.split(":")[0]) if head.user else None
    for pod, port in [(head, c.http_port), *[(p, c.metrics_port) for p in c.pods]]:
        found = listener_uid(m, pod, port)
        if found is None:
            raise CheckFailed(f"{pod.name}: nothing listens on {port}")
        pid, uid, cmd = found
        if uid == 0 or (want is not None and uid != want):
            raise CheckFailed(f"{pod.name}: pid {pid} ({cmd}) on port {port} runs as uid {uid}")
        log(f"{pod.name}: port {port}: pid {pid} runs as uid {uid} ({cmd})")


def _check_attention_kernel(m: Machine, workers: list[Pod]) -> None:
    """The engine built its CPU attention kernel in each worker with the image's compiler."""
    for pod in workers:
        out = m.exec(pod, ["sh", "-c", 'ls "$TANDEM_HOME"/kernels/paged_attention-*.so'], timeout=60)
        if out.returncode != 0:
            raise CheckFailed(f"{pod.name}: no CPU attention kernel built (no C compiler in the image?): {out.stderr}")
    log("each worker built the CPU attention kernel")


def run_check(c: Cluster, m: Machine, timeout: float, namespace: str, domain: str) -> dict:
    """The pods created, the head started and Ready, the Serve config PUT, the workers
    started, then every check in turn; what it measured and the chat reply (``CheckFailed``
    at the first that fails)."""
    head, workers = c.pods[0], c.pods[1:]
    summary: dict = {}
    _create_pods(c, m, namespace, domain)

    t0 = time.time()
    m.start(head)
    dashboard = f"http://{head.ip}:{DEFAULT_DASHBOARD_PORT}"
    _wait_head_ready(head, dashboard)
    summary["head_ready_s"] = round(time.time() - t0)

    _put_serve_config(c, dashboard)
    _start_workers(m, workers)
    _wait_app_running(c, dashboard, timeout)
    summary["app_running_s"] = round(time.time() - t0)

    _check_probes(c, head, workers)
    summary["reply"] = _ask_chat(c, m, head)
    summary["scrapes"] = _check_scrapes(c, head)
    _check_listener_uids(c, m, head)
    _check_attention_kernel(m, workers)
    return summary


def check_values(image: str, memory: str, object_store: int) -> dict:
    """Values that fit one small machine: one worker per group, 1 CPU and `memory` per pod,
    Ray's object store sized outright (nothing caps it to the pod's memory here, as the
    container's cgroup does on a node), and Ray's auth token (an offline render draws none:
    the chart cannot tell it from helm template). Everything else is the chart's default."""
    repo, _, tag = image.rpartition(":")
    params = {"object-store-memory": object_store}
    worker = {"replicas": 1, "cpu": "1", "memory": memory, "rayStartParams": params}
    return {
        "image": {"repository": repo, "tag": tag},
        "head": {"numCpus": 1, "resources": {"requests": {"cpu": "1", "memory": memory},
                                             "limits": {"cpu": "1", "memory": memory}},
                 "rayStartParams": params},
        "prefill": worker,
        "decode": worker,
        "rayAuth": {"token": secrets.token_hex(24)},
    }


def main(argv: list[str] | None = None) -> int:
    """The command line: render, build the pods, run the check and tear it all down; 0 when it passed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True)
    p.add_argument("--storage", required=True, help="buildah's storage (its --root; --runroot is beside it)")
    p.add_argument("--work", required=True, type=Path, help="logs and the pods' emptyDir folders")
    p.add_argument("--subnet", default="10.213.47", help="the pods' /24 (first three octets)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds for the application to be RUNNING")
    p.add_argument("--memory", default="3Gi", help="each pod's memory (limits, /dev/shm)")
    p.add_argument("--object-store-bytes", type=int, default=512 * 2**20)
    p.add_argument("--namespace", default="tandem")
    p.add_argument("--release", default="tandem")
    p.add_argument("--print-pods", action="store_true", help="print the pods as KubeRay would run them, and stop")
    args = p.parse_args(argv)
    storage = Path(args.storage)
    bah = ["buildah", "--root", str(storage / "root"), "--runroot", str(storage / "run"), "--storage-driver", "vfs"]

    docs = render(check_values(args.image, args.memory, args.object_store_bytes), args.release, args.namespace)
    tag = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
    cluster = build_cluster(docs, namespace=args.namespace, domain=DOMAIN, subnet=args.subnet, tag=tag)
    if args.print_pods:
        for pod in cluster.pods:
            print(json.dumps({"name": pod.name, "command": pod.command,
                              "env": {k: ("<token>" if k == "RAY_AUTH_TOKEN" else v) for k, v in pod.env},
                              "user": pod.user, "volumes": pod.volumes, "shm_bytes": pod.shm_bytes}, indent=1))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    machine = Machine(bah, args.image, args.work, args.subnet)
    log(f"KubeRay-style run of the chart: head + {len(cluster.pods) - 1} worker pod(s), "
        f"ingress {cluster.ingress}, Ray token auth {'on' if cluster.token else 'off'}")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        summary = run_check(cluster, machine, args.timeout, args.namespace, DOMAIN)
        print("image-check: kuberay summary " + json.dumps(summary), flush=True)
        return 0
    except (CheckFailed, KeyboardInterrupt) as e:
        print(f"image-check: FAILED: {e}", file=sys.stderr, flush=True)
        for pod in cluster.pods:
            if pod.log_path and pod.log_path.exists():
                print(f"--- {pod.name} log ({pod.log_path}), last lines:", file=sys.stderr)
                print(pod.log_path.read_text()[-2500:], file=sys.stderr)
        return 1
    finally:
        log("tearing the pods down")
        machine.stop(cluster.pods)


if __name__ == "__main__":
    sys.exit(main())
