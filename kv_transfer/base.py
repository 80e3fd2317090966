"""KV transfer between a prefill worker and a decode worker: shared types and interface.

One transfer moves one request's prompt KV, packed as two contiguous tensors (K and
V, each ``[layers, blocks, block_size, kv_heads, head_dim]``), so a transfer is two
large messages whatever the number of blocks.

Roles and the way of a transfer::

    prefill worker (sender)                         decode worker (receiver)
    -----------------------                         ------------------------
                                                    reserve blocks -> WAITING_FOR_REMOTE_KV
    prefill, sample first token
    payload = backend.prepare(meta, k, v)
    decode.receive_kv(meta, payload) ─────────────▶ k, v = backend.pull(meta, payload)
    backend.push(meta, k, v, payload)  ══ bytes ══▶ (collective: tagged send/recv on the pair's channel)
                                                    write into reserved blocks -> RUNNING
    ack or lease expiry ◀──────────────────────────
    backend.release(meta, payload)

Every transfer has a deadline: a pull or push that outlives it fails the transfer,
and the decode side's ``transfer.failure_policy`` decides what happens to the request.
States are ordered so that the slowest of several parts gives the state of the whole.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.wire.messages import KVLayout, TransferState  # noqa: F401  (re-exported)


class TransferError(RuntimeError):
    """A transfer failed; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # picklable across Ray, reason included
        return (type(self), (self.reason, str(self)))


@dataclass(frozen=True)
class TransferMeta:
    """Describes one transfer; small and picklable, it travels with the RPC."""

    transfer_id: str
    request_id: str
    layout: KVLayout
    num_blocks: int
    num_tokens: int
    dst_endpoint: str = ""  # the receiver's channel endpoint, for backends with channels
    deadline: float = 0.0  # time.time() after which the transfer has failed
    # Paged transfers: the receiver's blocks this one fills, in prompt order (a backend
    # that sends splits its messages by them; the receiver checks they are its own).
    dst_blocks: tuple[int, ...] = ()
    sender: str = ""  # the sending worker's id: a receiver waiting on its reads learns when it is gone
    checksums: tuple[int, ...] = ()  # one per block sent, when the sender sums them (kv_transfer.checksum)

    def time_left(self) -> float:
        return self.deadline - time.time()


@dataclass
class TransferStats:
    """Plain counters; the workers export them as metrics."""

    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_sending: float = 0.0
    seconds_receiving: float = 0.0
    failures: Counter = field(default_factory=Counter)  # by reason

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "failures"}
        d["failures"] = dict(self.failures)
        return d


# Blocking transfer calls run on their own threads: a backend may park a call until
# its turn comes, and parked calls must not starve the default executor.
MAX_CONCURRENT_TRANSFERS = 512


def contiguous_runs(src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(first, count) rows of the stretches where both ``src`` and ``dst`` go up by one."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    firsts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([firsts, [len(s)]]))
    return np.stack([s[firsts], counts], axis=1), np.stack([d[firsts], counts], axis=1)


def check_attachable(attached: object, k: torch.Tensor, v: torch.Tensor) -> None:
    """A paged backend's ``attach_cache`` checks: once only, one contiguous K and V."""
    if attached is not None:
        raise RuntimeError("a paged cache is already attached")
    if not (k.is_contiguous() and v.is_contiguous() and k.shape == v.shape and k.dtype == v.dtype):
        raise ValueError("the paged K and V must be contiguous tensors of one shape and dtype")


class KVTransferBackend(ABC):
    """One way of moving packed KV from a sender process to a receiver process.

    A ``paged`` backend moves blocks instead: each worker registers its paged cache once
    (``attach_cache``), the sender offers the ids of the blocks holding a prompt's KV
    (``prepare_blocks``, nothing copied), and the receiver reads them straight into the
    blocks it reserved (``pull_blocks``). Workers use that path when ``paged`` is set.
    """

    name: str = "abstract"
    paged: bool = False
    # Whether the sender's ``push`` moves the bytes; if not, the receiver reads them (or
    # they travel in the payload) and the sender has nothing to push.
    sends: bool = False

    def __init__(self) -> None:
        self.stats = TransferStats()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def endpoint(self) -> str:
        """Receiver: where senders open channels to this process; "" for backends without."""
        return ""

    def _submit(self, fn, *args) -> asyncio.Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(MAX_CONCURRENT_TRANSFERS, thread_name_prefix="kv-transfer")
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _by_deadline(self, meta: TransferMeta, fn, *args):
        # Submitted before waiting and shielded from the timeout: a peer-to-peer
        # operation must still run to completion so that the pair's message order
        # holds. Only its caller gives up at the deadline.
        future = self._submit(fn, *args)
        try:
            timeout = max(meta.time_left(), 0.0) if meta.deadline else None  # 0: no deadline
            return await asyncio.wait_for(asyncio.shield(future), timeout=timeout)
        except asyncio.TimeoutError:
            # Nobody awaits the operation now: consume its outcome so a late failure
            # is not reported as "exception never retrieved".
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline") from None

    async def pull_async(self, meta: TransferMeta, payload: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Receiver: ``pull`` off the event loop, failing with "timeout" at the deadline."""
        return await self._by_deadline(meta, self.pull, meta, payload)

    async def push_async(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor, payload: Any) -> None:
        """Sender: ``push`` off the event loop, failing with "timeout" at the deadline."""
        await self._by_deadline(meta, self.push, meta, k, v, payload)

    @abstractmethod
    def prepare(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor) -> Any:
        """Sender: make the payload the receiver needs to pull (picklable, small)."""

    def push(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor, payload: Any) -> None:
        """Sender: the blocking part of a send (only backends with a peer-to-peer send)."""

    @abstractmethod
    def pull(self, meta: TransferMeta, payload: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Receiver: fetch the packed K and V (blocking)."""

    # -- paged transfers (backends with ``paged``) --------------------------------

    def attach_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Both roles: this worker's paged K and V (``[layers, blocks, ...]`` each), once."""
        raise NotImplementedError(f"{self.name} moves packed KV, not blocks")

    def prepare_blocks(self, meta: TransferMeta, block_ids: list[int]) -> Any:
        """Sender: the payload that lets the receiver read these blocks of the attached cache."""
        raise NotImplementedError(f"{self.name} moves packed KV, not blocks")

    def pull_blocks(self, meta: TransferMeta, payload: Any, block_ids: list[int]) -> None:
        """Receiver: read the sender's blocks into ``block_ids`` of the attached cache (blocking)."""
        raise NotImplementedError(f"{self.name} moves packed KV, not blocks")

    async def pull_blocks_async(self, meta: TransferMeta, payload: Any, block_ids: list[int]) -> None:
        """Receiver: ``pull_blocks`` off the event loop, failing with "timeout" at the deadline."""
        await self._by_deadline(meta, self.pull_blocks, meta, payload, block_ids)

    async def pull_heads_async(
        self, meta: TransferMeta, payload: Any, block_ids: list[int], src: tuple[int, int], dst: tuple[int, int],
    ) -> None:
        """Receiver: read KV heads ``src`` of the sender's blocks into heads ``dst`` of
        ``block_ids`` (a tensor-parallel rank's share, ``kv_transfer.sharded``), failing
        with "timeout" at the deadline. Only a backend that reads in place can."""
        raise TransferError("layout", f"the {self.name} backend cannot read a share of a block's KV heads: "
                                      "KV moves between tensor-parallel workers over nixl only")

    def release(self, meta: TransferMeta, payload: Any) -> None:
        """Sender: drop its copy of the KV (on acknowledgement or lease expiry)."""

    def abandon(self, meta: TransferMeta, payload: Any) -> None:
        """Sender: the receiver gave up on this transfer; stop a push that waits for it."""

    def refuse(self, meta: TransferMeta, payload: Any) -> None:
        """Receiver: it will not read this transfer (a check failed first). A backend whose
        sender pushes takes the transfer's bytes off the way here, so that the push ends
        and nothing else on the pair waits on it (blocking)."""

    async def refuse_async(self, meta: TransferMeta, payload: Any) -> None:
        """``refuse`` off the event loop."""
        if self.sends:
            await self._submit(self.refuse, meta, payload)

    def close(self) -> None:
        """Drop every channel and buffer (the worker is going away)."""

    def recycle(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Receiver: the pulled tensors were copied into the cache; their memory may be reused."""

    def check_deadline(self, meta: TransferMeta) -> None:
        if meta.deadline and time.time() > meta.deadline:
            raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")


class WrappedBackend(KVTransferBackend):
    """A backend around another (``inner``), whose name and counters it shares: every call
    passes through unless a subclass changes it (``kv_transfer.faults.FaultyBackend`` adds
    faults to the receiving side, ``kv_transfer.packed.PackedAsPaged`` puts a packed backend
    behind the paged interface)."""

    def __init__(self, inner: KVTransferBackend) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.stats = inner.stats

    @property
    def endpoint(self) -> str:
        return self.inner.endpoint

    @property  # type: ignore[override]
    def paged(self) -> bool:
        return self.inner.paged

    @property  # type: ignore[override]
    def sends(self) -> bool:
        return self.inner.sends

    def prepare(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor) -> Any:
        return self.inner.prepare(meta, k, v)

    def push(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor, payload: Any) -> None:
        self.inner.push(meta, k, v, payload)

    async def push_async(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor, payload: Any) -> None:
        await self.inner.push_async(meta, k, v, payload)  # the inner backend's deadline rules

    def pull(self, meta: TransferMeta, payload: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.pull(meta, payload)

    def attach_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.attach_cache(k, v)

    def prepare_blocks(self, meta: TransferMeta, block_ids: list[int]) -> Any:
        return self.inner.prepare_blocks(meta, block_ids)

    def pull_blocks(self, meta: TransferMeta, payload: Any, block_ids: list[int]) -> None:
        self.inner.pull_blocks(meta, payload, block_ids)

    async def pull_blocks_async(self, meta: TransferMeta, payload: Any, block_ids: list[int]) -> None:
        await self.inner.pull_blocks_async(meta, payload, block_ids)  # the inner backend's deadline rules

    async def pull_heads_async(
        self, meta: TransferMeta, payload: Any, block_ids: list[int], src: tuple[int, int], dst: tuple[int, int],
    ) -> None:
        await self.inner.pull_heads_async(meta, payload, block_ids, src, dst)

    def release(self, meta: TransferMeta, payload: Any) -> None:
        self.inner.release(meta, payload)

    def abandon(self, meta: TransferMeta, payload: Any) -> None:
        self.inner.abandon(meta, payload)

    def refuse(self, meta: TransferMeta, payload: Any) -> None:
        self.inner.refuse(meta, payload)

    def close(self) -> None:
        self.inner.close()

    def recycle(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.recycle(k, v)
