"""Moving paged KV blocks between workers. ``make_backend(name)`` picks one.

``BACKENDS`` is importable without torch (command lines list it); the other names
load their modules on first use.
"""

from __future__ import annotations

import importlib

BACKENDS = ("nixl", "collective", "object_store", "inprocess")

_FROM_BASE = ("KVLayout", "KVTransferBackend", "TransferError", "TransferMeta", "TransferState", "TransferStats")
_BACKEND_CLASSES = {
    "nixl": ("kv_transfer.nixl", "NixlBackend"),
    "collective": ("kv_transfer.collective", "CollectiveBackend"),
    "object_store": ("kv_transfer.object_store", "ObjectStoreBackend"),
    "inprocess": ("kv_transfer.inprocess", "InProcessBackend"),
}


def __getattr__(name: str):
    if name in _FROM_BASE:
        return getattr(importlib.import_module("kv_transfer.base"), name)
    raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")


def make_backend(name: str):
    if name not in _BACKEND_CLASSES:
        raise ValueError(f"kv transfer backend must be one of {BACKENDS}, got {name!r}")
    module, cls = _BACKEND_CLASSES[name]
    return getattr(importlib.import_module(module), cls)()


__all__ = ["BACKENDS", *_FROM_BASE, "make_backend"]
