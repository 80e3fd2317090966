"""The Helm chart's RayService, rendered by Helm's own code (helm-python-sdk, as
tests/unit/test_deploy.py renders it), and the pods KubeRay's operator would make of it
(ray-operator/controllers/ray/common/pod.go), as plain data for ``kuberay_pods.py`` to run.

Each ``Pod`` gets the container command ``/bin/bash -c -- '<the container's args> && ulimit
-n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start ...'``, the flags built from the group's
``rayStartParams`` (``--block``, ``--metrics-export-port=8080``,
``--dashboard-agent-listen-port=52365``, ``num-cpus`` and ``memory`` from the container's
limits, ``num-gpus`` from a GPU limit, a worker's
``--address=<cluster>-head-svc.<namespace>.svc.<domain>:6379``), the environment KubeRay adds
(RAY_CLUSTER_NAME, RAY_CLOUD_INSTANCE_ID, RAY_NODE_TYPE_NAME, KUBERAY_GEN_RAY_START_CMD,
RAY_ADDRESS, FQ_RAY_IP, ...), the chart's own environment with Secrets and field references
resolved, its emptyDir volumes, the user of its securityContext, and a worker's
``wait-gcs-ready`` init container. The ``Cluster`` adds what the RayService controller
needs: the rendered ``serveConfigV2``, Ray's auth token and the head's ports.

Only the standard library and pyyaml here (helm-python-sdk where ``render`` runs); no
Kubernetes, no network, nothing started.
"""

from __future__ import annotations

import base64
import json
import math
import random
import re
import string
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "tandem"

# KubeRay's defaults (ray-operator/controllers/ray/utils/constant.go).
DEFAULT_GCS_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_METRICS_PORT = 8080
DEFAULT_AGENT_LISTEN_PORT = 52365
DOMAIN = "cluster.local"
LOGIN_SHELL = False  # KubeRay 1.4+: `bash -c`, `bash -lc` only with ENABLE_LOGIN_SHELL=true

_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_FACTORS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_value(q) -> int:
    """A Kubernetes quantity rounded up to an integer, as resource.Quantity.Value() does."""
    m = _QUANTITY.match(str(q).strip())
    if not m or m.group(2) not in _FACTORS:
        raise ValueError(f"not a Kubernetes quantity: {q!r}")
    return math.ceil(float(m.group(1)) * _FACTORS[m.group(2)] - 1e-9)


class CheckFailed(Exception):
    """What the check found wrong (the chart asks for something not emulated, a pod that
    exits, a probe or port that does not answer as KubeRay expects). Raised while the pods
    run, ``main`` prints it with each pod's last log lines, tears the pods down and returns 1."""


def render(values: dict, release: str, namespace: str) -> list[dict]:
    """The chart's objects, rendered by Helm's Go code (helm-python-sdk)."""
    import helm_python as helm

    chart = helm.Chart.load(CHART)
    try:
        manifests = chart.render(values, name=release, namespace=namespace)
    finally:
        chart.close()
    docs = []
    for path, text in manifests.items():
        if not path.endswith("NOTES.txt"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def convert_param_map(params: dict[str, str]) -> str:
    """KubeRay's convertParamMap: sorted keys; "true"/"false" are bare switches."""
    out = []
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard"):
            if value.lower() == "true":
                out.append(f" --{key} ")
        else:
            out.append(f" --{key}={value} ")
    return "".join(out)


def _accelerator_params(params: dict[str, str], limits: dict) -> None:
    """KubeRay's addWellKnownAcceleratorResources: num-gpus from a `*gpu` limit, unless
    rayStartParams.resources does not parse as JSON once quotes are trimmed, in which case
    the operator logs an error and adds nothing."""
    if not limits:
        return
    raw = params.get("resources")
    if raw is not None:
        try:
            json.loads(raw.strip("'\"` "))
        except ValueError:
            return
    for key in sorted(limits):
        if "num-gpus" not in params and (key.endswith("gpu") or re.search(r"nvidia\.com/mig-\d+g\.\d+gb$", key)):
            if quantity_value(limits[key]):
                params["num-gpus"] = str(quantity_value(limits[key]))


def ray_start_command(kind: str, start_params: dict, resources: dict, fqdn: str, head_port: str) -> str:
    """KubeRay's setMissingRayStartParams + generateRayStartCommand."""
    params = {k: str(v) for k, v in (start_params or {}).items()}
    if kind == "worker":
        params.setdefault("address", f"{fqdn}:{head_port}")
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(DEFAULT_METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(DEFAULT_AGENT_LISTEN_PORT))
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if "num-cpus" not in params:
        cpu = limits.get("cpu") or requests.get("cpu")
        if cpu and quantity_value(cpu):
            params["num-cpus"] = str(quantity_value(cpu))
    if "memory" not in params and limits.get("memory"):
        params["memory"] = str(quantity_value(limits["memory"]))
    _accelerator_params(params, limits)
    return ("ray start --head" if kind == "head" else "ray start") + convert_param_map(params)


def container_command(container: dict, ray_start: str) -> list[str]:
    """KubeRay's BuildPod: the container's own command and args run first, then ray start."""
    cmd = "".join(f" {v} " for v in (container.get("command") or []) + (container.get("args") or []))
    bash = ["/bin/bash", "-lc" if LOGIN_SHELL else "-c", "--"]
    if "ray start" in cmd:
        return (container.get("command") or []) + (container.get("args") or [])
    generated = f"ulimit -n ${{RAY_START_ULIMIT_OPEN_FILES:-65536}}; {ray_start}"
    return [*bash, f"{cmd} && {generated}" if cmd else generated]


@dataclass
class Pod:
    """One Ray node's pod as KubeRay would make it (``build_cluster``): its name, address
    and network namespace, the container's command, environment, user and emptyDirs; once
    ``Machine`` runs it, its buildah container, process and log."""

    name: str
    kind: str  # head | worker
    group: str  # headgroup | the worker group's name
    ip: str
    netns: str
    command: list[str]
    env: list[tuple[str, str]]
    user: str
    volumes: list[tuple[str, str]]  # (volume name, mount path) of emptyDirs
    shm_bytes: int
    init_command: list[str] | None = None
    ports: dict[str, int] = field(default_factory=dict)
    container: str = ""
    process: subprocess.Popen | None = None
    log_path: Path | None = None


@dataclass
class Cluster:
    """The rendered RayService as this check runs it (``build_cluster``): the pods, head
    first, and what the check needs to reach it: the Serve config it PUTs to the head's
    dashboard, Ray's auth token, the head Service's name and GCS port, the HTTP, gRPC and
    metrics ports, the ingress (``haproxy`` or Serve's ``proxy``) and the application's name."""

    pods: list[Pod]
    serve_config: dict
    token: str | None
    fqdn: str
    head_port: str
    http_port: int
    grpc_port: int
    metrics_port: int
    ingress: str
    app_name: str


def _env(entries, secrets: dict[str, dict[str, str]], meta: dict) -> list[tuple[str, str]]:
    """A container's env with valueFrom resolved as the kubelet does."""
    out = []
    for e in entries:
        if "value" in e:
            out.append((e["name"], str(e["value"])))
            continue
        src = e.get("valueFrom") or {}
        if "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            if ref["name"] not in secrets:
                raise CheckFailed(f"env {e['name']}: Secret {ref['name']} is not rendered by the chart")
            out.append((e["name"], secrets[ref["name"]][ref["key"]]))
        elif "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            value = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                     "status.podIP": meta["ip"]}.get(path) if not m else meta["labels"].get(m.group(1), "")
            if value is None:
                raise CheckFailed(f"env {e['name']}: fieldRef {path} not emulated")
            out.append((e["name"], value))
        elif e.get("name"):
            out.append((e["name"], ""))
    return out


def _has(env: list[tuple[str, str]], name: str) -> bool:
    return any(k == name for k, _ in env)


def _secrets(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The chart's Secrets, their data decoded."""
    return {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (d.get("data") or {}).items()}
        for d in docs if d["kind"] == "Secret"
    }


def _groups(rcc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], int]]:
    """(kind, group, spec, replicas): the head, then each worker group, its replicas within
    minReplicas and maxReplicas."""
    groups = [("head", "headgroup", rcc["headGroupSpec"], 1)]
    for g in rcc.get("workerGroupSpecs") or []:
        replicas = min(max(int(g.get("replicas", 1)), int(g.get("minReplicas", 0))), int(g.get("maxReplicas", 2**31)))
        groups.append(("worker", g["groupName"], g, replicas))
    return groups


def _add_kuberay_env(env: list[tuple[str, str]], *, kind: str, group: str, name: str, cluster_name: str,
                     namespace: str, fqdn: str, head_port: str, ray_start: str) -> None:
    """KubeRay's setContainerEnvVars (RayService), after the container's own env."""
    if kind == "worker":
        env += [("FQ_RAY_IP", fqdn), ("RAY_IP", fqdn.split(".")[0])]
    env += [("RAY_CLUSTER_NAME", cluster_name), ("RAY_CLUSTER_NAMESPACE", namespace),
            ("RAY_CLOUD_INSTANCE_ID", name), ("RAY_NODE_TYPE_NAME", group),
            ("KUBERAY_GEN_RAY_START_CMD", ray_start)]
    defaults = [("RAY_PORT", head_port), ("RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO", "0"),
                ("RAY_GCS_SERVER_REQUEST_TIMEOUT_SECONDS", "5"), ("RAY_SERVE_KV_TIMEOUT_S", "5"),
                ("RAY_ADDRESS", f"{'127.0.0.1' if kind == 'head' else fqdn}:{head_port}"),
                ("RAY_USAGE_STATS_KUBERAY_IN_USE", "1")]
    env += [(k, v) for k, v in defaults if not _has(env, k)]
    if kind == "head":
        env.append(("RAY_USAGE_STATS_EXTRA_TAGS", "kuberay_crd=RayService"))
    if not _has(env, "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE"):
        env.append(("RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "1"))


def _add_token_env(env: list[tuple[str, str]], rcc: dict[str, Any], secrets: dict[str, dict[str, str]]) -> None:
    """Token auth, where authOptions asks for it and the chart left it out of the env."""
    auth = rcc.get("authOptions") or {}
    if auth.get("mode") == "token":
        token = secrets.get(auth.get("secretName", ""), {}).get("auth_token")
        if not _has(env, "RAY_AUTH_MODE"):
            env.append(("RAY_AUTH_MODE", "token"))
        if not _has(env, "RAY_AUTH_TOKEN") and token:
            env.append(("RAY_AUTH_TOKEN", token))


def _volumes(name: str, pod_spec: dict[str, Any], container: dict[str, Any]) -> tuple[list[tuple[str, str]], int]:
    """(volume name, mount path) of the container's emptyDirs, and the size of its /dev/shm:
    emptyDirs become fresh folders; /dev/shm (medium Memory) the container's shm."""
    vols = {v["name"]: v for v in pod_spec.get("volumes") or []}
    mounts, shm = [], 64 * 2**20
    for vm in container.get("volumeMounts") or []:
        vol = vols.get(vm["name"])
        if vol is None or "emptyDir" not in vol:
            raise CheckFailed(f"{name}: volume {vm['name']} is not an emptyDir; only emptyDirs are emulated")
        if vm["mountPath"] == "/dev/shm":
            limits = (container.get("resources") or {}).get("limits") or {}
            limit = vol["emptyDir"].get("sizeLimit") or limits.get("memory")
            shm = quantity_value(limit) if limit else shm
        else:
            mounts.append((vm["name"], vm["mountPath"]))
    return mounts, shm


def _user(pod_spec: dict[str, Any], container: dict[str, Any]) -> str:
    """uid:gid of the securityContext (the container's over the pod's), or "" where it sets none."""
    sc = {**(pod_spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    return f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}" if "runAsUser" in sc else ""


def _wait_gcs_ready(fqdn: str, head_port: str) -> list[str]:
    """KubeRay's wait-gcs-ready init container of a worker (same env as the Ray container)."""
    return ["/bin/bash", "-c", "--", (
        "SECONDS=0; while true; do "
        f"if ray health-check --address {fqdn}:{head_port} >/dev/null 2>&1; "
        "then echo 'GCS is ready.'; break; fi; "
        "if (( SECONDS > 120 )); then echo 'GCS not ready after 120 s'; exit 1; fi; "
        'echo "$SECONDS seconds elapsed: Waiting for GCS to be ready."; sleep 5; done')]


def _cluster(pods: list[Pod], spec: dict[str, Any], secrets: dict[str, dict[str, str]], fqdn: str,
             head_port: str) -> Cluster:
    """The pods with the RayService's Serve config, the operator's token and the head's ports."""
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    (app,) = serve_config["applications"]
    token = None
    auth = spec["rayClusterConfig"].get("authOptions") or {}
    if auth.get("mode") == "token":
        token = secrets.get(auth.get("secretName", ""), {}).get("auth_token")
        if not token:
            raise CheckFailed(f"authOptions names Secret {auth.get('secretName')!r}, which the chart does not render")
    head_env = dict(pods[0].env)
    return Cluster(
        pods=pods, serve_config=serve_config, token=token, fqdn=fqdn, head_port=head_port,
        http_port=int(serve_config["http_options"]["port"]), grpc_port=int(serve_config["grpc_options"]["port"]),
        metrics_port=int(head_env.get("TANDEM_METRICS_PORT", app["args"].get("metrics_port", 8081))),
        ingress="haproxy" if head_env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "proxy",
        app_name=app["name"],
    )


def build_cluster(docs: list[dict], *, namespace: str, domain: str, subnet: str, tag: str) -> Cluster:
    """The pods KubeRay would make of the rendered RayService (head, then each worker group's
    replicas), with their commands, environment and volumes."""
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    secrets = _secrets(docs)
    spec = rs["spec"]
    rcc = spec["rayClusterConfig"]
    cluster_name = f"{rs['metadata']['name']}-{tag}"  # KubeRay: <rayservice>-<5 random>
    head_spec = rcc["headGroupSpec"]
    head_port = str((head_spec.get("rayStartParams") or {}).get("port", DEFAULT_GCS_PORT))
    fqdn = f"{cluster_name}-head-svc.{namespace}.svc.{domain}"

    pods: list[Pod] = []
    rand = random.Random(tag)
    for kind, group, gspec, replicas in _groups(rcc):
        template = gspec["template"]
        pod_spec = template["spec"]
        (container, *_) = pod_spec["containers"]
        for _ in range(replicas):
            suffix = "".join(rand.choices(string.ascii_lowercase + string.digits, k=5))
            name = f"{cluster_name}-head-{suffix}" if kind == "head" else f"{cluster_name}-{group}-worker-{suffix}"
            ip = f"{subnet}.{10 + len(pods)}"
            labels = {**(template.get("metadata", {}).get("labels") or {}), "ray.io/cluster": cluster_name,
                      "ray.io/group": group, "ray.io/node-type": kind, "ray.io/is-ray-node": "yes"}
            meta = {"name": name, "namespace": namespace, "ip": ip, "labels": labels}
            ray_start = ray_start_command(kind, gspec.get("rayStartParams") or {}, container.get("resources") or {},
                                          fqdn, head_port)
            env = _env(container.get("env") or [], secrets, meta)
            # KubeRay's setContainerEnvVars (RayService), then token auth where the chart left it out.
            _add_kuberay_env(env, kind=kind, group=group, name=name, cluster_name=cluster_name,
                             namespace=namespace, fqdn=fqdn, head_port=head_port, ray_start=ray_start)
            _add_token_env(env, rcc, secrets)
            mounts, shm = _volumes(name, pod_spec, container)
            user = _user(pod_spec, container)
            init = _wait_gcs_ready(fqdn, head_port) if kind == "worker" else None
            ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports") or []}
            pods.append(Pod(name=name, kind=kind, group=group, ip=ip, netns=f"tdmck-{len(pods)}",
                            command=container_command(container, ray_start), env=env, user=user,
                            volumes=mounts, shm_bytes=shm, init_command=init, ports=ports))
    return _cluster(pods, spec, secrets, fqdn, head_port)

