"""Runs the Helm chart's RayService the way KubeRay runs it, on one machine, with no
Kubernetes: a pod per Ray node (the head and each worker group's replicas), each a buildah
container of the image in a network namespace of its own, on a bridge, as pods are on a
cluster network. Used by scripts/image-check.

From the chart rendered by Helm's own code (helm-python-sdk, as tests/unit/test_deploy.py
renders it), each pod gets what KubeRay's operator would give it (ray-operator/controllers/
ray/common/pod.go): the container command ``/bin/bash -c -- '<the container's args> &&
ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start ...'``, the flags built from the
group's ``rayStartParams`` (``--block``, ``--metrics-export-port=8080``,
``--dashboard-agent-listen-port=52365``, ``num-cpus`` and ``memory`` from the container's
limits, a worker's ``--address=<cluster>-head-svc.<namespace>.svc.<domain>:6379``), the
environment KubeRay adds (RAY_CLUSTER_NAME, RAY_CLOUD_INSTANCE_ID, RAY_NODE_TYPE_NAME,
KUBERAY_GEN_RAY_START_CMD, RAY_ADDRESS, FQ_RAY_IP, ...), the chart's own environment with
Secrets and field references resolved, its emptyDir volumes, the user of its
securityContext, and a worker's ``wait-gcs-ready`` init container. Then, as the RayService
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
import base64
import contextlib
import json
import math
import os
import random
import re
import secrets
import shlex
import signal
import socket
import string
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
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


def log(msg: str) -> None:
    print(f"image-check: {msg}", flush=True)


class CheckFailed(Exception):
    """What the check found wrong (the chart asks for something not emulated, a pod that
    exits, a probe or port that does not answer as KubeRay expects). Raised while the pods
    run, ``main`` prints it with each pod's last log lines, tears the pods down and returns 1."""


# ------------------------------------------------------------------ the rendered chart


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


# ------------------------------------------------------------------------- the machine


def sh(*cmd: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise CheckFailed(f"{shlex.join(cmd)}: exit {out.returncode}: {out.stderr.strip()[-500:]}")
    return out


def http(url: str, *, method: str = "GET", body: dict | None = None, token: str | None = None,
         timeout: float = 10) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


class ClusterDNS:
    """The cluster's DNS (kube-dns) for the pods: A records for the names given, NXDOMAIN
    for any other, on UDP port 53 of the bridge's address. Ray's gRPC resolves the head
    Service's name with c-ares, which asks the resolv.conf's nameserver, as on a cluster."""

    def __init__(self, address: str, records: dict[str, str]):
        self.records = {k.lower().rstrip("."): socket.inet_aton(v) for k, v in records.items()}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.5)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _question(packet: bytes) -> tuple[str, int, int]:
        labels, i = [], 12
        while packet[i]:
            labels.append(packet[i + 1:i + 1 + packet[i]].decode(errors="replace"))
            i += 1 + packet[i]
        qtype = struct.unpack("!H", packet[i + 1:i + 3])[0]
        return ".".join(labels).lower(), qtype, i + 5

    def answer(self, packet: bytes) -> bytes:
        name, qtype, end = self._question(packet)
        ip = self.records.get(name)
        flags = 0x8180 if ip is not None else 0x8183  # response, recursion available; NXDOMAIN
        answers = b""
        if ip is not None and qtype == 1:
            answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 30, 4) + ip
        header = struct.pack("!HHHHHH", struct.unpack("!H", packet[:2])[0], flags, 1, 1 if answers else 0, 0, 0)
        return header + packet[12:end] + answers

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                packet, peer = self.sock.recvfrom(512)
                self.sock.sendto(self.answer(packet), peer)
            except TimeoutError:
                continue
            except (OSError, IndexError, struct.error):
                continue

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2)
        self.sock.close()


class Machine:
    """Network namespaces on a bridge, and a buildah container per pod."""

    BRIDGE = "tdmck-br0"

    def __init__(self, bah: list[str], image: str, work: Path, subnet: str):
        self.bah, self.image, self.work, self.subnet = bah, image, work, subnet
        self.dns: ClusterDNS | None = None

    # The namespaces and links this check names; left over from a run that was killed.
    def clean_network(self) -> None:
        names = sh("ip", "netns", "list", check=False).stdout.split()
        for ns in names:
            if ns.startswith("tdmck-"):
                sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", self.BRIDGE, check=False)

    def network(self, pods: list[Pod]) -> None:
        self.clean_network()
        if sh("ip", "-o", "addr", check=False).stdout.find(f" {self.subnet}.") >= 0:
            raise CheckFailed(f"{self.subnet}.0/24 is in use on this machine; pick another with --subnet")
        sh("ip", "link", "add", self.BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.BRIDGE)
        sh("ip", "link", "set", self.BRIDGE, "up")
        for i, pod in enumerate(pods):
            host_end, pod_end = f"tdmck-h{i}", f"tdmck-p{i}"
            sh("ip", "netns", "add", pod.netns)
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", pod_end)
            sh("ip", "link", "set", pod_end, "netns", pod.netns)
            sh("ip", "link", "set", host_end, "master", self.BRIDGE, "up")
            inside = ["ip", "netns", "exec", pod.netns]
            sh(*inside, "ip", "link", "set", "lo", "up")
            sh(*inside, "ip", "link", "set", pod_end, "name", "eth0")
            sh(*inside, "ip", "addr", "add", f"{pod.ip}/24", "dev", "eth0")
            sh(*inside, "ip", "link", "set", "eth0", "up")
            # A default route (through this machine, which forwards nothing) lets Ray find
            # the pod's address as it does on a cluster network.
            sh(*inside, "ip", "route", "add", "default", "via", f"{self.subnet}.1")

    def create(self, pod: Pod, namespace: str, domain: str) -> None:
        """The pod's container: /etc/hosts and resolv.conf as the kubelet writes them (its
        own name, the cluster DNS with the namespace's search path), /dev/shm of the pod's
        size, the open-file limit of a container runtime (containerd's: the machine's)."""
        hard = int(sh("bash", "-c", "ulimit -Hn").stdout.strip())
        args = [*self.bah, "from", "--pull=never", "--name", pod.name, "--shm-size", f"{pod.shm_bytes // 1024}k",
                "--ulimit", f"nofile={hard}:{hard}", "--add-host", f"{pod.name}:{pod.ip}",
                "--dns", f"{self.subnet}.1", "--dns-option", "ndots:5"]
        for search in (f"{namespace}.svc.{domain}", f"svc.{domain}", domain):
            args += ["--dns-search", search]
        pod.container = sh(*args, self.image).stdout.strip().splitlines()[-1]
        cfg = [*self.bah, "config", "--hostname", pod.name]
        for k, v in pod.env:
            cfg += ["--env", f"{k}={v}"]
        sh(*cfg, pod.container)
        uid, _, gid = (pod.user or "0:0").partition(":")
        for vol, _path in pod.volumes:  # an emptyDir, owned by the pod's fsGroup as the kubelet does
            d = self.work / "pods" / pod.name / vol
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, int(uid), int(gid or uid))
            d.chmod(0o2777)

    def run_args(self, pod: Pod, command: list[str]) -> list[str]:
        args = ["ip", "netns", "exec", pod.netns, *self.bah, "run", "--isolation", "chroot"]
        if pod.user:
            args += ["--user", pod.user]
        for vol, path in pod.volumes:
            args += ["-v", f"{self.work / 'pods' / pod.name / vol}:{path}"]
        return [*args, pod.container, "--", *command]

    def start(self, pod: Pod) -> None:
        pod.log_path = self.work / f"pod-{pod.group}-{pod.name[-5:]}.log"
        with open(pod.log_path, "w") as f:
            pod.process = subprocess.Popen(self.run_args(pod, pod.command), stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    def exec(self, pod: Pod, command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.run_args(pod, command), capture_output=True, text=True, timeout=timeout)

    def in_netns(self, pod: Pod, *cmd: str) -> str:
        return sh("ip", "netns", "exec", pod.netns, *cmd, check=False).stdout

    def pids(self, pods: list[Pod]) -> list[int]:
        """The processes in the pods' network namespaces: the containers' and nothing else."""
        out = []
        for pod in pods:
            out += [int(x) for x in sh("ip", "netns", "pids", pod.netns, check=False).stdout.split()]
        return [p for p in out if p != os.getpid()]

    def stop(self, pods: list[Pod]) -> None:
        """As a pod's deletion: SIGTERM to the container's processes, SIGKILL after a grace period."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 3)):
            for pid in self.pids(pods):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.time() + wait
            while time.time() < deadline and self.pids(pods):
                time.sleep(0.5)
        for pod in pods:
            if pod.process:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pod.process.wait(timeout=10)
            if pod.container:
                sh(*self.bah, "rm", pod.container, check=False)
        if self.dns:
            self.dns.close()
        self.clean_network()


def _listener_uid(machine: Machine, pod: Pod, port: int) -> tuple[int, int, str] | None:
    """(pid, uid, command) of the process listening on `port` in the pod's namespace."""
    out = machine.in_netns(pod, "ss", "-ltnpH", f"sport = :{port}")
    m = re.search(r"pid=(\d+)", out)
    if not m:
        return None
    pid = int(m.group(1))
    status = Path(f"/proc/{pid}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:70]
    return pid, uid, cmdline


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
    listener = _listener_uid(m, head, c.http_port)
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
        found = _listener_uid(m, pod, port)
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
