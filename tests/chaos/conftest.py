"""The chaos modules' scenarios, run grouped by transfer backend.

A module keeps one live service at a time (``streams.Services``) and asking for another
backend's shuts the current one down, so scenarios are put in backend order within
each module (stable: otherwise as written): each backend's service starts once per
module, not once per switch between parametrized scenarios.
"""

from __future__ import annotations

BACKEND_ORDER = ("object_store", "collective", "nixl")


def _backend(item) -> int:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return next((BACKEND_ORDER.index(v) for v in params.values() if isinstance(v, str) and v in BACKEND_ORDER), -1)


def pytest_collection_modifyitems(session, config, items) -> None:
    here = __name__.rpartition(".")[0] + "."
    positions = [i for i, item in enumerate(items) if item.module.__name__.startswith(here)]
    modules: dict[str, int] = {}
    for i in positions:
        modules.setdefault(items[i].module.__name__, len(modules))
    ordered = sorted((items[i] for i in positions), key=lambda it: (modules[it.module.__name__], _backend(it)))
    for i, item in zip(positions, ordered):
        items[i] = item
