"""scripts/image-check and the Dockerfile settings it relies on, checked without building:
the base image and torch's index are build arguments whose defaults keep a plain
`docker build` as it was, the script's translation of this machine's pip settings into
the build's /etc/pip.conf and read-only mounts, and scripts/kuberay_pods.py's pods (the
`ray start` lines and environment KubeRay's operator would give the rendered chart's
pods) and its cluster DNS."""

from __future__ import annotations

import configparser
import importlib.util
import re
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
SCRIPT = REPO / "scripts" / "image-check"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _torch_install(flavour: str) -> str:
    """The shell command of the Dockerfile's RUN line that installs torch."""
    lines = (DOCKER / f"Dockerfile.{flavour}").read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("RUN pip install") and "torch==" in x]
    return line.removeprefix("RUN ")


def _pip_args(command: str, env: dict[str, str]) -> list[str]:
    """The arguments `pip` gets when the RUN line runs in a shell with these build args."""
    script = 'pip() { printf "%s\\n" "$@"; }\n' + command
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_cpu_dockerfile_takes_its_base_as_a_build_arg_defaulting_to_python_slim():
    text = (DOCKER / "Dockerfile.cpu").read_text()
    before_from, _, _ = text.partition("\nFROM ")
    (default,) = re.findall(r"^ARG BASE=(\S+)$", before_from, re.M)
    assert default == "python:3.11-slim"
    assert re.findall(r"^FROM (.+)$", text, re.M) == ["${BASE}"]


@pytest.mark.parametrize(
    ("flavour", "default"), [("cpu", CPU_INDEX), ("gpu", "https://download.pytorch.org/whl/cu130")]
)
def test_torch_index_defaults_to_pytorchs_and_an_empty_one_leaves_pip_its_settings(flavour, default):
    text = (DOCKER / f"Dockerfile.{flavour}").read_text()
    assert re.findall(r"^ARG TORCH_INDEX_URL=(\S+)$", text, re.M) == [default]
    command = _torch_install(flavour)
    env = {"TORCH_VERSION": "2.13.0", "PATH": "/usr/bin:/bin"}
    assert _pip_args(command, {**env, "TORCH_INDEX_URL": default}) == ["install", "torch==2.13.0", "--index-url", default]
    assert _pip_args(command, {**env, "TORCH_INDEX_URL": ""}) == ["install", "torch==2.13.0"]


def test_script_parses_and_rejects_an_unknown_argument():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "--severity=info", str(SCRIPT)], check=True)
    out = subprocess.run([str(SCRIPT), "--no-such-flag"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown argument --no-such-flag" in out.stderr


def _pip_settings(tmp_path: Path, pip_conf: str, env: dict[str, str], skip: str = "") -> tuple[dict, list[str]]:
    """Runs the script's pip_settings with this pip config file and environment (pip loads
    it after the machine's own files, which the callers' keys therefore override)."""
    config = tmp_path / "host-pip.conf"
    config.write_text(pip_conf)
    work = tmp_path / "work"
    environ = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_CONFIG_FILE": str(config), **env}
    python = Path(shutil.which("python3")).parent  # the pip that the script asks: this one's
    environ["PATH"] = f"{python}:{environ['PATH']}"
    out = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; work="{work}"; pip_settings "{skip}"'],
        env=environ, capture_output=True, text=True, check=True,
    )
    parser = configparser.ConfigParser()
    parser.read(work / "pip" / "pip.conf")
    return dict(parser["global"]), out.stdout.splitlines()


def test_pip_settings_become_the_builds_pip_conf_with_local_paths_mounted(tmp_path):
    index, wheels, cert = tmp_path / "simple", tmp_path / "wheels", tmp_path / "ca.pem"
    index.mkdir(), wheels.mkdir(), cert.write_text("")
    conf = f"[global]\nextra-index-url = file://{index} https://example.invalid/simple\nfind-links = /nonexistent\n"
    settings, mounts = _pip_settings(tmp_path, conf, {"PIP_FIND_LINKS": str(wheels), "PIP_CERT": str(cert)})
    assert {k: settings[k] for k in ("extra-index-url", "find-links", "cert")} == {
        "extra-index-url": f"file://{index} https://example.invalid/simple",
        "find-links": str(wheels),  # the environment wins over the file, as in pip
        "cert": "/opt/pip-host/cert.pem",  # apart from the image's own CA bundle
    }
    ours = [m for m in mounts if m.startswith(str(tmp_path))]
    assert sorted(ours) == sorted([f"{tmp_path}:{tmp_path}:ro", f"{wheels}:{wheels}:ro", f"{cert}:/opt/pip-host/cert.pem:ro"])


def test_pip_settings_skip_the_keys_asked(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    settings, mounts = _pip_settings(tmp_path, "[global]\ntimeout = 60\n", {"PIP_FIND_LINKS": str(wheels)}, skip="find-links")
    assert settings["timeout"] == "60"
    assert "find-links" not in settings
    assert not [m for m in mounts if m.startswith(str(tmp_path))]


# ------------------------------------------- scripts/kuberay_pods.py: pods as KubeRay makes them


def _kuberay_pods():
    pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")
    spec = importlib.util.spec_from_file_location("kuberay_pods", REPO / "scripts" / "kuberay_pods.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kuberay_pods", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return sys.modules["kuberay_pods"]


def test_ray_start_flags_are_built_as_kuberays_convert_param_map():
    kp = _kuberay_pods()
    # sorted keys, a bare switch for "true", nothing for "false", --k=v otherwise
    assert kp.convert_param_map({"num-cpus": "2", "block": "true", "include-dashboard": "false", "disable-usage-stats": "false"}) == (
        " --block  --include-dashboard=false  --num-cpus=2 ")
    worker = kp.ray_start_command("worker", {"resources": '"{\\"a\\":1}"'}, {"limits": {"cpu": "1500m", "memory": "1Gi"}},
                                  "c-head-svc.ns.svc.cluster.local", "6379")
    assert worker == ('ray start --address=c-head-svc.ns.svc.cluster.local:6379  --block  '
                      '--dashboard-agent-listen-port=52365  --memory=1073741824  --metrics-export-port=8080  '
                      '--num-cpus=2  --resources="{\\"a\\":1}" ')


def test_kuberay_adds_num_gpus_from_the_limit_only_where_resources_parse():
    """KubeRay's addWellKnownAcceleratorResources: rayStartParams.resources in the shell
    quoting KubeRay's docs show ('"{\\"a\\":1}"') does not parse once trimmed, and the
    operator then adds no num-gpus."""
    kp = _kuberay_pods()
    limits = {"limits": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "2"}}
    assert "--num-gpus=2" in kp.ray_start_command("worker", {}, limits, "h", "6379")
    assert "--num-gpus=2" in kp.ray_start_command("worker", {"resources": "'{\"a\": 1}'"}, limits, "h", "6379")
    assert "num-gpus" not in kp.ray_start_command("worker", {"resources": '"{\\"a\\":1}"'}, limits, "h", "6379")


def test_the_rendered_chart_becomes_a_head_and_a_pod_per_worker_replica():
    kp = _kuberay_pods()
    docs = kp.render(kp.check_values("localhost/tandem:cpu", "3Gi", 2**29), "tandem", "tandem")
    cluster = kp.build_cluster(docs, namespace="tandem", domain="cluster.local", subnet="10.9.8", tag="abcde")
    head, prefill, decode = cluster.pods
    assert (head.kind, prefill.group, decode.group) == ("head", "prefill", "decode")
    assert cluster.fqdn == "tandem-abcde-head-svc.tandem.svc.cluster.local"
    shell, flag, dashes, script = head.command
    assert (shell, flag, dashes) == ("/bin/bash", "-c", "--")
    # the chart's args first (the metrics folder emptied), then KubeRay's ulimit and ray start
    cleanup, _, start = script.partition(" && ")
    assert "find" in cleanup and start.startswith("ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start --head --block ")
    assert f"--address={cluster.fqdn}:6379 " in prefill.command[3]
    env = dict(prefill.env)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == cluster.token and len(cluster.token) == 48
    assert env["RAY_NODE_TYPE_NAME"] == "prefill" and env["RAY_CLOUD_INSTANCE_ID"] == prefill.name
    assert env["KUBERAY_GEN_RAY_START_CMD"] in prefill.command[3]
    assert prefill.user == "1000:1000" and ("metrics", "/tmp/tandem-metrics") in prefill.volumes
    assert prefill.shm_bytes == 3 * 2**30
    assert cluster.serve_config["applications"][0]["import_path"] == "cluster.service:app"
    assert (cluster.http_port, cluster.ingress) == (8000, "haproxy")


def test_the_cluster_dns_answers_the_head_service_and_nothing_else():
    kp = _kuberay_pods()

    def query(name: str, qtype: int = 1) -> bytes:
        labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
        return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)

    dns = kp.ClusterDNS.__new__(kp.ClusterDNS)
    dns.records = {"h-head-svc.ns.svc.cluster.local": socket.inet_aton("10.9.8.10")}
    answer = dns.answer(query("H-head-svc.ns.svc.cluster.local"))
    ident, flags, _, ancount, _, _ = struct.unpack("!HHHHHH", answer[:12])
    assert (ident, flags & 0xF, ancount) == (0x1234, 0, 1) and answer.endswith(socket.inet_aton("10.9.8.10"))
    _, flags, _, ancount, _, _ = struct.unpack("!HHHHHH", dns.answer(query("h-head-svc.ns.svc.cluster.local.ns.svc.cluster.local"))[:12])
    assert (flags & 0xF, ancount) == (3, 0)  # NXDOMAIN: the resolver tries the next search suffix
    _, flags, _, ancount, _, _ = struct.unpack("!HHHHHH", dns.answer(query("h-head-svc.ns.svc.cluster.local", 28))[:12])
    assert (flags & 0xF, ancount) == (0, 0)  # AAAA: the name exists, no IPv6 address
