"""The overhead benchmark's processes: which process of the service is what (``classify``,
``discover``), their CPU times (``snapshot``), the CPU each spent over the load
(``cpu_deltas``) summed by kind (``by_kind``), and the per-kind table (``format_table``).
All but ``snapshot`` and ``discover`` (psutil) are pure.

``bench/overhead.py`` is the program: it snapshots these processes around the load and
prints the table; its docstring lists the kinds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

KINDS = ("decode", "router", "ingress", "client", "prefill", "driver", "control", "ray", "other")
ROUTER_DEPLOYMENT = "Router"
# Ray's own helper processes, known by the script they run.
RAY_SCRIPTS = {
    "dashboard/agent.py": "dashboard agent",
    "dashboard/dashboard.py": "dashboard",
    "runtime_env/agent/main.py": "runtime env agent",
    "log_monitor.py": "log monitor",
    "autoscaler/_private/monitor.py": "autoscaler monitor",
}
ACTORS = {
    "ProxyActor": ("ingress", "Serve proxy actor"),
    "HAProxyManager": ("ingress", "HAProxyManager actor"),
    "DecodeWorker": ("decode", "decode worker"),
    "ColocatedWorker": ("decode", "colocated worker"),
    "PrefillWorker": ("prefill", "prefill worker"),
    "ServeController": ("control", "Serve controller"),
    "ClusterController": ("control", "cluster controller"),
    "NodeMetricsExporter": ("control", "metrics exporter"),
    "DashboardAgent": ("ray", "dashboard agent"),
    "RuntimeEnvAgent": ("ray", "runtime env agent"),
}


# -- pure parts: which process is what, and the arithmetic ------------------------------


def classify(name: str, cmdline: Sequence[str]) -> tuple[str, str] | None:
    """(kind, component) of a process from its name and command line; None: not ours.

    Ray titles an actor's process ``ray::<Class>`` (``ray::<Class>.<method>`` while a
    method runs, ``ray::<actor name>:<Class>.<method>`` for some named actors, and
    ``ray::ServeReplica:<app>:<deployment>`` for a Serve replica).
    """
    title = " ".join(cmdline) if cmdline else name
    if title.startswith("ray::"):
        actor = title[len("ray::"):].split(" ")[0]
        if "ServeReplica:" in actor:
            actor = actor[actor.index("ServeReplica:"):]
        elif ":" in actor:
            actor = actor.rsplit(":", 1)[1]
        if actor.startswith("ServeReplica:"):
            deployment = actor.split(":")[-1].split(".")[0]
            return ("router", "router replica") if deployment == ROUTER_DEPLOYMENT else ("other", actor)
        cls = actor.split(".")[0]
        if cls in ACTORS:
            return ACTORS[cls]
        return "ray", "idle workers" if cls == "IDLE" else f"actor {cls}"
    program = os.path.basename(cmdline[0]) if cmdline else name
    if program == "haproxy" or name == "haproxy":
        return "ingress", "haproxy"
    if name in ("raylet", "gcs_server") or program in ("raylet", "gcs_server"):
        return "ray", name if name in ("raylet", "gcs_server") else program
    for script, component in RAY_SCRIPTS.items():
        if any(arg.endswith(script) for arg in cmdline):
            return "ray", component
    return None


@dataclass(frozen=True)
class Proc:
    """One process of the service: its kind, component and CPU seconds, as of a snapshot or as
    spent between two (``cpu_deltas``)."""

    pid: int
    kind: str
    component: str
    cpu_s: float  # user + system, since the process started


@dataclass
class KindRow:
    """One row of the table: a kind's processes, their CPU seconds over the load,
    and each component's share."""

    kind: str
    processes: int = 0
    cpu_s: float = 0.0
    components: dict[str, float] = field(default_factory=dict)  # component -> CPU seconds

    def ms_per_token(self, tokens: int) -> float:
        return per_token_ms(self.cpu_s, tokens)


def per_token_ms(seconds: float, tokens: int) -> float:
    """Milliseconds per token; a ValueError for a run that received no tokens."""
    if tokens <= 0:
        raise ValueError(f"no output tokens were received (got {tokens}): nothing to divide by")
    return seconds * 1000.0 / tokens


def cpu_deltas(before: Iterable[Proc], after: Iterable[Proc]) -> list[Proc]:
    """Each process's CPU spent between the two snapshots (a process that appeared in
    between counts from zero; one that exited in between is lost, and left out)."""
    start = {p.pid: p.cpu_s for p in before}
    return [Proc(p.pid, p.kind, p.component, max(0.0, p.cpu_s - start.get(p.pid, 0.0))) for p in after]


def by_kind(deltas: Iterable[Proc]) -> list[KindRow]:
    """One row per kind (in ``KINDS`` order, kinds with no process left out)."""
    rows = {k: KindRow(k) for k in KINDS}
    for p in deltas:
        row = rows.setdefault(p.kind, KindRow(p.kind))
        row.processes += 1
        row.cpu_s += p.cpu_s
        row.components[p.component] = row.components.get(p.component, 0.0) + p.cpu_s
    return [r for r in rows.values() if r.processes]


def format_table(rows: Sequence[KindRow], tokens: int, notes: dict[str, str] | None = None) -> str:
    """The per-kind table, components of a kind with several indented below it."""
    notes = notes or {}

    def line(label: str, procs: str, cpu_s: float, note: str = "") -> str:
        return f"{label:<28}{procs:>6}{cpu_s:>9.2f}{per_token_ms(cpu_s, tokens):>10.3f}  {note}".rstrip()

    lines = [f"{'kind':<28}{'procs':>6}{'CPU s':>9}{'ms/token':>10}  notes", "-" * 68]
    for r in rows:
        lines.append(line(r.kind, str(r.processes), r.cpu_s, notes.get(r.kind, "")))
        if len(r.components) > 1:
            for name, cpu in sorted(r.components.items(), key=lambda kv: -kv[1]):
                lines.append(line(f"  {name}", "", cpu))
    lines += ["-" * 68, line("total", str(sum(r.processes for r in rows)), sum(r.cpu_s for r in rows))]
    return "\n".join(lines)


# -- finding and reading processes ---------------------------------------------------------


def snapshot(pids: dict[int, tuple[str, str]]) -> list[Proc]:
    """The current CPU time of each known process still alive."""
    import psutil

    out = []
    for pid, (kind, component) in pids.items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out.append(Proc(pid, kind, component, t.user + t.system))
    return out


def discover(descendants_only: bool, workers: dict[int, tuple[str, str]]) -> dict[int, tuple[str, str]]:
    """pid -> (kind, component) for the service's processes, this process excluded.

    ``workers``: the worker actors' pids as they reported them (their role is certain).
    """
    import psutil

    me = psutil.Process()
    procs = me.children(recursive=True) if descendants_only else [p for p in psutil.process_iter() if p.pid != me.pid]
    found = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            label = workers.get(proc.pid) or classify(proc.name(), proc.cmdline())
            if label is None and descendants_only:
                label = ("other", proc.name())
            if label is not None:
                found[proc.pid] = label
    return found
