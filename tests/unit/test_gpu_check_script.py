"""``scripts/gpu-check`` runs its steps in order, each test file of tests/gpu in one of
them, and leaves its results in ``$OUT`` (or ``--out-dir``) after every step.

A stand-in python (``PYTHON``) records each call and fails where told, so the script's
own logic runs here without a GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["preflight", "kernels", "parity", "nccl", "transfer", "bench"]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "fake-python $*"
# The summary written before this step must show it running.
grep -q '"running"' "$RESULTS/gpu-check.json" || { echo "no running step in gpu-check.json"; exit 9; }
case "$*" in *"$FAIL"*) exit 3 ;; esac
"""


def _gpu_check(tmp_path: Path, *args: str, fail: str = "never-matches", **env: str):
    """Run the script; returns its process and the folder its results should be in."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    results = Path(args[args.index("--out-dir") + 1] if "--out-dir" in args else env["OUT"])
    full_env = {k: v for k, v in os.environ.items() if k != "OUT"}
    full_env.update(PYTHON=str(fake), FAIL=fail, RESULTS=str(results), **env)
    proc = subprocess.run(
        [str(ROOT / "scripts/gpu-check"), *args], cwd=ROOT, env=full_env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return proc, results


def test_steps_run_in_order_into_out_and_name_every_gpu_test_file(tmp_path):
    proc, out = _gpu_check(tmp_path, OUT=str(tmp_path / "handed-back"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "gpu-check.json").read_text())
    assert list(summary) == [*STEPS, "exit"] and summary["exit"] == 0, summary
    assert all(summary[s]["exit"] == 0 and summary[s]["limit"] > 0 for s in STEPS), summary
    assert sum(summary[s]["limit"] for s in STEPS) <= 360, "the limits must fit 6 minutes"
    log = (out / "gpu-check.log").read_text()
    named = set(re.findall(r"tests/gpu/(test_\w+\.py)", log))
    files = {p.name for p in (ROOT / "tests/gpu").glob("test_*.py")}
    assert named == files, f"tests/gpu files no step runs: {files - named}"
    assert "--durations=15" in log and f"--junitxml={out}/tests-kernels.xml" in log


def test_a_failing_step_fails_the_check_and_the_later_steps_still_run(tmp_path):
    proc, out = _gpu_check(
        tmp_path, "--out-dir", str(tmp_path / "given"), fail="test_engine_parity",
        OUT=str(tmp_path / "not-this"),
    )  # fmt: skip
    assert proc.returncode == 1
    summary = json.loads((out / "gpu-check.json").read_text())
    assert summary["parity"]["exit"] == 3 and summary["exit"] == 1, summary
    assert summary["transfer"]["exit"] == 0 and summary["bench"]["exit"] == 0, summary
    assert not (tmp_path / "not-this").exists(), "--out-dir comes before $OUT"


def test_a_failing_preflight_stops_before_any_test(tmp_path):
    proc, out = _gpu_check(tmp_path, "--out-dir", str(tmp_path / "out"), fail="tests.gpu.preflight")
    assert proc.returncode == 1
    summary = json.loads((out / "gpu-check.json").read_text())
    assert list(summary) == ["preflight", "exit"] and summary["preflight"]["exit"] == 3, summary
