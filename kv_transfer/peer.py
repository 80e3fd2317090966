"""A bare transfer endpoint (a Ray actor): a backend and nothing else.

Used by the backend conformance tests and the transfer benchmark to exercise a
backend between two processes without engines in the way.
"""

from __future__ import annotations

import time

import torch

from kv_transfer import KVLayout, TransferError, TransferMeta
from kv_transfer.config import TransferConfig


def make_kv(layout: KVLayout, num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    shape = layout.packed_shape(num_blocks)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def checksum(k: torch.Tensor, v: torch.Tensor) -> float:
    return float(k.double().sum() + 2 * v.double().sum())


class TransferPeer:
    def __init__(self, transfer: TransferConfig) -> None:
        torch.set_num_threads(1)
        self.backend = transfer.make_backend()
        self._held: dict[str, tuple] = {}

    def join(self, world_size: int, rank: int, generation: int) -> int:
        self.backend.join(world_size, rank, generation)
        return rank

    def rank(self) -> int:
        return self.backend.rank

    def prepare(self, meta: TransferMeta, seed: int):
        """Make KV from ``seed``; returns (payload, checksum)."""
        k, v = make_kv(meta.layout, meta.num_blocks, seed)
        payload = self.backend.prepare(meta, k, v)
        self._held[meta.transfer_id] = (k, v, payload)
        return payload, checksum(k, v)

    async def push(self, meta: TransferMeta) -> float:
        k, v, payload = self._held[meta.transfer_id]
        t0 = time.perf_counter()
        await self.backend.push_async(meta, k, v, payload)
        return time.perf_counter() - t0

    def release(self, meta: TransferMeta) -> None:
        k, v, payload = self._held.pop(meta.transfer_id)
        self.backend.release(meta, payload)

    async def pull(self, meta: TransferMeta, payload) -> tuple[float, float]:
        """Receive into a resident buffer, as a worker copies into its cache.

        Returns (checksum, seconds from the call until the bytes sit in that buffer).
        """
        t0 = time.perf_counter()
        try:
            k, v = await self.backend.pull_async(meta, payload)
        except TransferError as e:  # counted here, as a worker counts them
            self.backend.stats.failures[e.reason] += 1
            raise
        dst = self._resident(2 * k.numel(), k.dtype)
        dst[: k.numel()].copy_(k.view(-1))
        dst[k.numel() :].copy_(v.view(-1))
        elapsed = time.perf_counter() - t0
        total = checksum(k, v)
        self.backend.recycle(k, v)
        return total, elapsed

    def _resident(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self, "_cache", None)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._cache = torch.zeros(n, dtype=dtype)  # zeros: touch the pages now
        return buf[:n]

    def stats(self) -> dict:
        return self.backend.stats.as_dict()

    # Raw ray.util.collective send/recv into existing buffers: the benchmark's baseline.
    def raw_setup(self, nbytes: int) -> None:
        self._raw = torch.empty(nbytes, dtype=torch.uint8)

    def raw_send(self, dst: int) -> float:
        from ray.util import collective

        t0 = time.perf_counter()
        collective.send(self._raw, dst, "default")
        return time.perf_counter() - t0

    def raw_recv(self, src: int) -> float:
        from ray.util import collective

        t0 = time.perf_counter()
        collective.recv(self._raw, src, "default")
        return time.perf_counter() - t0
