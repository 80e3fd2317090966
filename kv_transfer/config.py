"""Transfer settings shared by both sides of a transfer."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kv_transfer.faults import FaultConfig

if TYPE_CHECKING:
    from kv_transfer.base import KVTransferBackend

FAILURE_POLICIES = ("recompute", "fail")
# How much longer a sender keeps what it offered than a receiver may take to read it: a
# read may run a little past its deadline before it is given up (nixl's STUCK_GRACE_S),
# and the two sides' clocks are read at different moments.
LEASE_MARGIN_S = 10.0


def default_backend() -> str:
    """``nixl`` where its packages are installed (scripts/install puts them in), else
    ``collective``. Looked up without importing them: UCX loads only in the workers."""
    return "nixl" if importlib.util.find_spec("nixl") is not None else "collective"


@dataclass(frozen=True)
class TransferConfig:
    """The ``transfer:`` settings: backend, deadline and lease, failure policy, pipelining,
    checksums and injected faults; checked on creation. Workers get it at start and may take a
    new one live (``set_transfer``)."""

    backend: str = field(default_factory=default_backend)  # nixl | collective | object_store | inprocess
    timeout_s: float = 30.0  # deadline of one transfer, from the reservation
    lease_s: float = 60.0  # the sender frees its copy (or its blocks) after this without an ack
    failure_policy: str = "recompute"  # what the decode side does when KV does not come
    op_timeout_s: float = 60.0  # a channel operation gives up after this, deadline or not
    # Paged backends: the blocks of each finished prefill chunk are read while the next
    # chunks compute; the last chunk's blocks come with the first token.
    pipeline: bool = True
    # The sender sums every block it sends and the receiver checks the sums before using
    # the KV (kv_transfer.checksum): each side reads the blocks once more, at memory speed
    # (20-30 GB/s a CPU thread, 329 GB/s on an H200), and with ``pipeline`` only the last
    # part's sums follow the prefill (1-4 ms of a 1.2 s TTFT here: docs/BENCHMARKS.md).
    # On, a block that is not what was sent fails its transfer instead of being served.
    checksums: bool = True
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        from kv_transfer import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"kv transfer backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"transfer.failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}"
            )
        for name in ("timeout_s", "lease_s", "op_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lease_s < self.timeout_s + LEASE_MARGIN_S:
            # A receiver may read until the deadline: what it reads must still be there.
            raise ValueError(
                f"lease_s ({self.lease_s}) must be at least timeout_s ({self.timeout_s}) + {LEASE_MARGIN_S}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> TransferConfig:
        """Settings as a topology file writes them: ``faults`` may be a mapping too."""
        faults = d.get("faults", {})
        if isinstance(faults, dict):
            d = {**d, "faults": FaultConfig(**faults)}
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"unknown transfer setting: {e}") from e

    def make_backend(self) -> KVTransferBackend:
        from kv_transfer import make_backend

        return self.configure(make_backend(self.backend))

    def configure(self, backend):
        """``backend`` (this config's kind, bare or wrapped in faults) under these settings:
        its channel operations' deadline, and the faults to inject (if any)."""
        from kv_transfer.faults import FaultyBackend

        inner = backend.inner if isinstance(backend, FaultyBackend) else backend
        if inner.name != self.backend:
            raise ValueError(f"a {inner.name} backend cannot take {self.backend} settings")
        if self.backend == "collective":
            inner.op_timeout_s = self.op_timeout_s
        return FaultyBackend(inner, self.faults) if self.faults.active else inner
