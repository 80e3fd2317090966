"""The tree passes its linter and, on the pure core, a strict type checker (settings in
pyproject.toml: ``[tool.ruff]``, ``[tool.mypy]``). Also: ``pre-commit run --all-files``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, f"ruff check:\n{out.stdout}{out.stderr}"


def test_mypy_strict_passes_on_the_pure_core():
    out = _run("mypy", "--no-incremental")
    assert out.returncode == 0, f"mypy:\n{out.stdout}{out.stderr}"
