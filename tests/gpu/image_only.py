"""Python as on the GPU image: only its packages import, every other one is missing.

``tests/gpu/image-packages.txt`` lists the image's distributions. Of the packages
installed here, those distributions and everything they require (by their metadata,
as pip would have installed them) stay importable, as do the standard library and this
project's own packages; every other installed top-level module is refused, the way an
absent package is: ``import`` raises ModuleNotFoundError and ``importlib.util.find_spec``
returns None (transformers probes its optional packages that way). So a module-level
``import ray`` or ``import gguf`` on the GPU path fails here, in CI, rather than first on
a lent GPU.

    python -m tests.gpu.image_only -m pytest tests/gpu      # the GPU tests, image packages only
    python -m tests.gpu.image_only -c "import bench.gpu"
"""

from __future__ import annotations

import importlib.metadata as md
import re
import runpy
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES_FILE = Path(__file__).with_name("image-packages.txt")


def image_distributions(path: Path = PACKAGES_FILE) -> list[str]:
    """The distribution names the file lists, normalized (PEP 503)."""
    names = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [_normalize(n) for n in names if n]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: md.Distribution) -> Iterable[str]:
    """The distributions ``dist`` requires unconditionally (markers met, no extras)."""
    from packaging.requirements import Requirement

    for spec in dist.requires or ():
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            yield _normalize(req.name)


def closure(names: Iterable[str]) -> set[str]:
    """``names`` and every installed distribution they require, transitively."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_requirements(md.distribution(name)))
        except md.PackageNotFoundError:
            pass  # on the image, not here (cupy): nothing of it can be imported here anyway
    return seen


def project_packages() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/__init__.py")}


def hidden_modules(allowed_distributions: Iterable[str]) -> frozenset[str]:
    """Installed top-level modules that belong to none of ``allowed_distributions``."""
    allowed = closure(allowed_distributions)
    own = project_packages() | set(sys.stdlib_module_names)
    return frozenset(
        module
        for module, dists in md.packages_distributions().items()
        if module not in own and not any(_normalize(d) in allowed for d in dists)
    )


class _Hide:
    """Wraps one finder of ``sys.meta_path``: finds nothing for a hidden module."""

    def __init__(self, inner, hidden: frozenset[str]) -> None:
        self.inner, self.hidden = inner, hidden

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.hidden:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None


def hide_all_but_image_packages() -> frozenset[str]:
    """From now on this interpreter imports only what the image has; returns the
    modules hidden. Modules already imported stay (import this first)."""
    # packaging is read before hiding (it may not be one of the image's packages).
    hidden = hidden_modules(image_distributions())
    sys.meta_path[:] = [_Hide(f, hidden) for f in sys.meta_path]
    return hidden


def main(argv: list[str]) -> None:
    usage = "usage: python -m tests.gpu.image_only (-m MODULE | -c CODE) [ARGS...]"
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        sys.exit(usage)
    hide_all_but_image_packages()
    flag, target, rest = argv[0], argv[1], argv[2:]
    if flag == "-c":
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
