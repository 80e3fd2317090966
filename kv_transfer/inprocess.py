"""In-process backend: sender and receiver share one registry. For unit tests."""

from __future__ import annotations

import threading

import torch

from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta


class InProcessBackend(KVTransferBackend):
    """Sender and receiver in one process, sharing this object: ``prepare`` keeps K and V under the
    transfer id until ``release``, and ``pull`` returns copies."""

    name = "inprocess"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor) -> str:
        with self._lock:
            self._store[meta.transfer_id] = (k, v)
        self.stats.sent += 1
        self.stats.bytes_sent += k.nbytes + v.nbytes
        return meta.transfer_id

    def pull(self, meta: TransferMeta, payload: str) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_deadline(meta)
        with self._lock:
            kv = self._store.get(payload)
        if kv is None:
            raise TransferError("missing", f"transfer {meta.transfer_id} has no data (released?)")
        k, v = (t.clone() for t in kv)
        self.stats.received += 1
        self.stats.bytes_received += k.nbytes + v.nbytes
        return k, v

    def release(self, meta: TransferMeta, payload: str) -> None:
        with self._lock:
            self._store.pop(payload, None)

    @property
    def num_held(self) -> int:
        return len(self._store)
