"""Metrics folders: a process's own, removed at its shutdown; those of dead processes swept."""

from __future__ import annotations

import os
import subprocess
import sys

from cluster import metrics_server


def test_a_new_folder_sweeps_those_of_processes_no_longer_running(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.delenv(metrics_server.ENV, raising=False)
    parent = tmp_path / "metrics"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited: no process has this id now (barring reuse)
    for name in (str(dead_pid), f"soak-{dead_pid}", f"overhead-{os.getppid()}", "notes"):
        (parent / name).mkdir(parents=True)
        (parent / name / "counter_1.db").write_bytes(b"x")
    mine = metrics_server.process_metrics_dir("bench")
    assert mine == str(parent / f"bench-{os.getpid()}") and os.environ[metrics_server.ENV] == mine
    left = sorted(p.name for p in parent.iterdir())
    assert left == sorted([f"bench-{os.getpid()}", f"overhead-{os.getppid()}", "notes"]), (
        "the dead process's folders go; a running one's and a folder not named for a process stay"
    )
    metrics_server.remove_metrics_dir(mine)
    assert not os.path.exists(mine)
