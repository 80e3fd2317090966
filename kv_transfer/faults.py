"""Fault injection for transfers, switched on by configuration (chaos tests, drills).

``FaultyBackend`` wraps any backend: on the receiving side it drops a share of
transfers (``drop_rate``) or delays them (``delay_s``), so that the decode side's
deadline and ``transfer.failure_policy`` paths run for real.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta, WrappedBackend


@dataclass(frozen=True)
class FaultConfig:
    """The ``transfer.faults`` settings: the share of transfers to drop and the delay before each
    receive, with the drops' seed; all zero injects nothing."""

    drop_rate: float = 0.0  # share of transfers that fail on the receiver
    delay_s: float = 0.0  # added before every receive
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.drop_rate <= 1.0:
            raise ValueError(f"drop_rate must be in [0, 1], got {self.drop_rate}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")

    @property
    def active(self) -> bool:
        return self.drop_rate > 0 or self.delay_s > 0


class FaultyBackend(WrappedBackend):
    """A backend (``inner``) with a ``FaultConfig``'s faults on its receiving side; all else passes
    through. ``TransferConfig.configure`` wraps a backend in one while faults are on."""

    def __init__(self, inner: KVTransferBackend, faults: FaultConfig) -> None:
        super().__init__(inner)
        self.faults = faults
        self._rng = random.Random(faults.seed)

    def pull(self, meta: TransferMeta, payload):
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        if self._rng.random() < self.faults.drop_rate:
            # Still drain the bytes, so a peer-to-peer sender is not left hanging, and
            # hand back the receive buffers they landed in.
            self.inner.recycle(*self.inner.pull(meta, payload))
            raise TransferError("injected", f"transfer {meta.transfer_id} dropped by fault injection")
        return self.inner.pull(meta, payload)

    # -- paged backends: the same faults around a read into reserved blocks (or a rank's
    # share of them: rank 0's own, at tensor_parallel_size above one) ----------------

    def pull_blocks(self, meta, payload, block_ids) -> None:
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        drop = self._rng.random() < self.faults.drop_rate
        self.inner.pull_blocks(meta, payload, block_ids)  # read anyway, as ``pull`` does
        if drop:
            raise TransferError("injected", f"transfer {meta.transfer_id} dropped by fault injection")

    async def pull_blocks_async(self, meta, payload, block_ids) -> None:
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        drop = self._rng.random() < self.faults.drop_rate
        await self.inner.pull_blocks_async(meta, payload, block_ids)  # the inner backend's deadline rules
        if drop:
            raise TransferError("injected", f"transfer {meta.transfer_id} dropped by fault injection")

    async def pull_heads_async(self, meta, payload, block_ids, src, dst) -> None:
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        drop = self._rng.random() < self.faults.drop_rate
        await self.inner.pull_heads_async(meta, payload, block_ids, src, dst)  # read anyway, as above
        if drop:
            raise TransferError("injected", f"transfer {meta.transfer_id} dropped by fault injection")
