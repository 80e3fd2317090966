"""Packed backends seen as paged ones, so that the workers speak one interface.

A packed backend (the Ray object store; gloo staged through host memory on GPUs) moves a
request's KV as one K and one V tensor, ``[layers, blocks, block_size, kv_heads,
head_dim]`` each. ``PackedAsPaged`` wraps one: offering blocks gathers them into a
packed copy (``prepare_blocks``; the copy is what the backend sends, kept until
``release``), and a read into reserved blocks pulls the packed copy and scatters it
into them (``pull_blocks``, off the event loop). The workers call ``as_paged`` on
whatever backend the settings make and never ask which kind it is.
"""

from __future__ import annotations

import threading

import torch

from kv_transfer.base import KVTransferBackend, TransferMeta, WrappedBackend, check_attachable


class PackedAsPaged(WrappedBackend):
    """A packed backend (``inner``) behind the paged interface, as the module docstring
    describes; ``as_paged`` wraps one when a worker starts. Each offered packed copy
    is kept until ``release``."""

    paged = True

    def __init__(self, inner: KVTransferBackend) -> None:
        super().__init__(inner)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self._sent: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # transfer id -> its packed copy

    def attach_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        check_attachable(self._cache, k, v)
        self._cache = (k, v)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self._cache[0].device)

    def prepare_blocks(self, meta: TransferMeta, block_ids: list[int]):
        index = self._index(block_ids)
        k, v = (cache.index_select(1, index) for cache in self._cache)
        payload = self.inner.prepare(meta, k, v)
        with self._lock:
            self._sent[meta.transfer_id] = (k, v)
        return payload

    def _packed(self, meta: TransferMeta) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            return self._sent[meta.transfer_id]

    def push(self, meta: TransferMeta, k, v, payload) -> None:
        self.inner.push(meta, *self._packed(meta), payload)

    async def push_async(self, meta: TransferMeta, k, v, payload) -> None:
        await self.inner.push_async(meta, *self._packed(meta), payload)

    def pull_blocks(self, meta: TransferMeta, payload, block_ids: list[int]) -> None:
        self._scatter(block_ids, *self.inner.pull(meta, payload))

    async def pull_blocks_async(self, meta: TransferMeta, payload, block_ids: list[int]) -> None:
        k, v = await self.inner.pull_async(meta, payload)  # the inner backend's deadline rules
        await self._submit(self._scatter, block_ids, k, v)

    def _scatter(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        try:
            index = self._index(block_ids)
            for cache, packed in zip(self._cache, (k, v)):
                cache.index_copy_(1, index, packed.to(cache.device))
        finally:
            self.inner.recycle(k, v)

    def release(self, meta: TransferMeta, payload) -> None:
        with self._lock:
            self._sent.pop(meta.transfer_id, None)
        self.inner.release(meta, payload)


def as_paged(backend: KVTransferBackend) -> KVTransferBackend:
    """``backend`` itself if it reads and writes blocks in place, else wrapped."""
    return backend if backend.paged else PackedAsPaged(backend)


def reconfigure(backend: KVTransferBackend, transfer) -> KVTransferBackend:
    """``backend`` (as ``as_paged`` made it) under new transfer settings (a
    ``TransferConfig``): the wrapped backend is what takes them."""
    if isinstance(backend, PackedAsPaged):
        backend.inner = transfer.configure(backend.inner)
        backend.stats = backend.inner.stats
        return backend
    return transfer.configure(backend)
