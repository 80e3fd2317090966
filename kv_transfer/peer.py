"""A bare transfer endpoint (a Ray actor): a backend and nothing else.

Used by the backend conformance tests and the transfer benchmark to exercise a
backend between two processes without engines in the way.
"""

from __future__ import annotations

import datetime
import hashlib
import time

import torch

from kv_transfer import KVLayout, TransferError, TransferMeta
from kv_transfer.checksum import block_checksums
from kv_transfer.checksum import check as check_sums
from kv_transfer.config import TransferConfig


def make_kv(layout: KVLayout, num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    shape = layout.packed_shape(num_blocks)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def checksum(k: torch.Tensor, v: torch.Tensor) -> str:
    """sha256 of K's bytes then V's: any changed, lost or reordered byte shows."""
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TransferPeer:
    """One end of a transfer in the conformance tests and the transfer benchmark, run as a Ray
    actor: a backend of the given settings, KV made from a seed, and checksums of what arrives.
    What it offers is held until ``release``."""

    def __init__(self, transfer: TransferConfig) -> None:
        torch.set_num_threads(1)
        self.backend = transfer.make_backend()
        self._held: dict[str, tuple] = {}

    def endpoint(self) -> str:
        return self.backend.endpoint

    def pid(self) -> int:
        import os

        return os.getpid()

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

    # Paged backends: a paged cache of random KV on each side, blocks read in place.
    def attach(self, layout: KVLayout, num_blocks: int, seed: int) -> None:
        self._paged = make_kv(layout, num_blocks, seed)
        self.backend.attach_cache(*self._paged)

    def prepare_blocks(self, meta: TransferMeta, block_ids: list[int], sums: bool = False):
        """Offer blocks of the attached cache; returns (payload, checksum of those blocks,
        and with ``sums`` their per-block sums as a worker sends them and the seconds
        those took)."""
        k, v = self._paged
        t0 = time.perf_counter()
        block_sums = block_checksums(k, v, block_ids) if sums else ()
        summed = time.perf_counter() - t0
        payload = self.backend.prepare_blocks(meta, block_ids)
        self._held[meta.transfer_id] = (None, None, payload)
        return payload, checksum(k[:, block_ids], v[:, block_ids]), block_sums, summed

    async def pull_blocks(self, meta: TransferMeta, payload, block_ids: list[int]) -> tuple[str, float]:
        """Read into ``block_ids`` of the attached cache, checking the per-block sums
        when ``meta`` carries them, as a worker does: (their checksum, seconds)."""
        t0 = time.perf_counter()
        await self.backend.pull_blocks_async(meta, payload, block_ids)
        k, v = self._paged
        if meta.checksums:
            check_sums(meta, block_checksums(k, v, block_ids))
        elapsed = time.perf_counter() - t0
        return checksum(k[:, block_ids], v[:, block_ids]), elapsed

    # A bare two-rank gloo group sending into existing buffers: the benchmark's baseline.
    def raw_setup(self, nbytes: int, rank: int, store_addr: str | None = None) -> str:
        """Rank 1 hosts the rendezvous and returns its address; rank 0 joins it (blocking)."""
        from torch.distributed import ProcessGroupGloo, TCPStore

        self._raw = torch.empty(nbytes, dtype=torch.uint8)
        if rank == 1:
            self._raw_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            return f"127.0.0.1:{self._raw_store.port}"
        host, port = store_addr.rsplit(":", 1)
        self._raw_store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        self._raw_pg = ProcessGroupGloo(self._raw_store, 0, 2, datetime.timedelta(seconds=60))
        return store_addr

    def raw_join(self) -> None:
        from torch.distributed import ProcessGroupGloo

        self._raw_pg = ProcessGroupGloo(self._raw_store, 1, 2, datetime.timedelta(seconds=60))

    def raw_send(self, tag: int) -> float:
        t0 = time.perf_counter()
        self._raw_pg.send([self._raw], 1, tag).wait()
        return time.perf_counter() - t0

    def raw_recv(self, tag: int) -> float:
        t0 = time.perf_counter()
        self._raw_pg.recv([self._raw], 0, tag).wait()
        return time.perf_counter() - t0
