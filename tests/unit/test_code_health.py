"""The tree passes its linter and, on the pure core, a strict type checker (settings in
pyproject.toml: ``[tool.ruff]``, ``[tool.mypy]``), and every public class of the
packages has a docstring. Also: ``pre-commit run --all-files``."""

from __future__ import annotations

import ast
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


PACKAGES = ("engine", "kv_transfer", "prefill_worker", "decode_worker", "router", "cluster", "sim", "bench", "load", "tandem")


def _public_classes(tree: ast.Module):
    """Classes at module level and inside them (not those a function makes for itself)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ClassDef):
            if not node.name.startswith("_"):
                yield node
            todo.extend(node.body)


def test_every_public_class_says_what_it_is_for():
    missing = [
        f"{path.relative_to(ROOT)}:{cls.lineno} {cls.name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        for cls in _public_classes(ast.parse(path.read_text()))
        if not ast.get_docstring(cls)
    ]
    assert not missing, "public classes without a docstring:\n" + "\n".join(missing)
