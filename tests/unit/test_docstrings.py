"""Every public class says what it is for: a docstring on each module-level class whose
name does not start with "_", in every package of the house (generated protobuf stubs
excepted).

Read from the source with ``ast``: nothing is imported, so no torch, Ray or network
library loads.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "engine", "router", "cluster", "kv_transfer", "prefill_worker", "decode_worker", "bench",
)


def _modules() -> list[Path]:
    """Every module of ``PACKAGES``, generated ``*_pb2*.py`` stubs left out."""
    return sorted(
        path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
        if "_pb2" not in path.name
    )


def _undocumented(source: str, where: str) -> list[str]:
    """``where:line ClassName`` for each public module-level class of ``source`` that has
    no docstring."""
    return [
        f"{where}:{node.lineno} {node.name}"
        for node in ast.parse(source, filename=where).body
        if isinstance(node, ast.ClassDef)
        and not node.name.startswith("_")
        and ast.get_docstring(node) is None
    ]


def test_the_check_names_public_module_level_classes_without_a_docstring_only():
    source = '''
class Documented:
    """Says what it is for."""

class Bare:
    x: int = 0  # a comment is no docstring

class _Private:
    pass

def function():
    class Local:
        pass
'''
    assert _undocumented(source, "m.py") == ["m.py:5 Bare"]


def test_the_walk_reaches_every_package():
    found = {path.relative_to(ROOT).parts[0] for path in _modules()}
    assert found == set(PACKAGES), f"expected modules in each of {PACKAGES}, found {sorted(found)}"


def test_every_public_class_has_a_docstring():
    missing = [
        entry
        for path in _modules()
        for entry in _undocumented(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert not missing, (
        "each public class needs a docstring saying what it is for (and, when it holds "
        "state, its lifecycle or who owns it); these have none:\n  " + "\n  ".join(missing)
    )
