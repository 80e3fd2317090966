"""The machine ``kuberay_pods.py`` runs the chart's pods on, as a cluster would run them:
a network namespace per pod on a bridge (the pods' /24, the bridge's address their
gateway), the cluster's DNS answering the head Service's name, and a buildah container
of the image per pod (chroot isolation, the pod's user, emptyDirs as fresh folders,
/dev/shm of the pod's size). Also the shell and HTTP calls the check makes. Needs root.

A pod's life here::

    Machine.network ─▶ Machine.create ─▶ Machine.start (its command, logged) ─▶ Machine.stop
                                         (Machine.exec runs a command beside it: init, probes)

Only the standard library here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from kuberay_render import CheckFailed, Pod


def sh(*cmd: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run a command, its output captured; ``CheckFailed`` on a non-zero exit when ``check``."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise CheckFailed(f"{shlex.join(cmd)}: exit {out.returncode}: {out.stderr.strip()[-500:]}")
    return out


def http(url: str, *, method: str = "GET", body: dict | None = None, token: str | None = None,
         timeout: float = 10) -> tuple[int, str]:
    """(status, body) of a request, a JSON ``body`` and Ray's bearer ``token`` where given;
    status 0 with the error where nothing answered."""
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
        """The reply to a query: its A record, no answer for another type, NXDOMAIN for an unknown name."""
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
        """Stop answering and free the port."""
        self.stopped.set()
        self.thread.join(timeout=2)
        self.sock.close()


class Machine:
    """Network namespaces on a bridge, and a buildah container per pod."""

    BRIDGE = "tdmck-br0"

    def __init__(self, bah: list[str], image: str, work: Path, subnet: str):
        self.bah, self.image, self.work, self.subnet = bah, image, work, subnet
        self.dns: ClusterDNS | None = None

    def clean_network(self) -> None:
        """Remove the namespaces and links this check names (left over from a run that was killed)."""
        names = sh("ip", "netns", "list", check=False).stdout.split()
        for ns in names:
            if ns.startswith("tdmck-"):
                sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", self.BRIDGE, check=False)

    def network(self, pods: list[Pod]) -> None:
        """The bridge, and each pod's namespace on it at the pod's address."""
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
        """``buildah run`` of ``command`` in the pod's container, namespace, user and emptyDirs."""
        args = ["ip", "netns", "exec", pod.netns, *self.bah, "run", "--isolation", "chroot"]
        if pod.user:
            args += ["--user", pod.user]
        for vol, path in pod.volumes:
            args += ["-v", f"{self.work / 'pods' / pod.name / vol}:{path}"]
        return [*args, pod.container, "--", *command]

    def start(self, pod: Pod) -> None:
        """Run the pod's command in the background, its output to the pod's log."""
        pod.log_path = self.work / f"pod-{pod.group}-{pod.name[-5:]}.log"
        with open(pod.log_path, "w") as f:
            pod.process = subprocess.Popen(self.run_args(pod, pod.command), stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    def exec(self, pod: Pod, command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``command`` in the pod's container to its end (an init container, a look inside)."""
        return subprocess.run(self.run_args(pod, command), capture_output=True, text=True, timeout=timeout)

    def in_netns(self, pod: Pod, *cmd: str) -> str:
        """The output of a host command run in the pod's network namespace."""
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


def listener_uid(machine: Machine, pod: Pod, port: int) -> tuple[int, int, str] | None:
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
