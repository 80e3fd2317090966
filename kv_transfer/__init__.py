"""Moving paged KV blocks between workers. ``make_backend(name)`` picks one."""

from kv_transfer.base import (
    KVLayout,
    KVTransferBackend,
    TransferError,
    TransferMeta,
    TransferState,
    TransferStats,
)

BACKENDS = ("collective", "object_store", "nixl", "inprocess")


def make_backend(name: str) -> KVTransferBackend:
    if name == "collective":
        from kv_transfer.collective import CollectiveBackend

        return CollectiveBackend()
    if name == "object_store":
        from kv_transfer.object_store import ObjectStoreBackend

        return ObjectStoreBackend()
    if name == "nixl":
        from kv_transfer.nixl import NixlBackend

        return NixlBackend()
    if name == "inprocess":
        from kv_transfer.inprocess import InProcessBackend

        return InProcessBackend()
    raise ValueError(f"kv transfer backend must be one of {BACKENDS}, got {name!r}")


__all__ = [
    "BACKENDS",
    "KVLayout",
    "KVTransferBackend",
    "TransferError",
    "TransferMeta",
    "TransferState",
    "TransferStats",
    "make_backend",
]
