"""NIXL backend: the receiver reads the sender's KV with one-sided READs.

NIXL (UCX underneath; DRAM here, VRAM where UCX has CUDA) moves bytes between
registered memory regions without the sender taking part: on one host UCX reads
the sender's pages straight out of its process (CMA), across hosts over RDMA.
This is the pull model of vLLM's NIXL connector.

Paged (what the workers run): each worker registers its whole paged cache once
(``attach_cache``). The sender offers the ids of the blocks that hold a prompt's KV
(``prepare_blocks``: no copy; the engine keeps the blocks until the receiver has
answered), with its cache's base addresses and the metadata that lets a receiver
connect (the same every time, loaded once per sender). The receiver turns both
block lists into descriptors, one per stretch of blocks consecutive on both sides,
per layer, for K and V (``[layers, blocks, ...]``: block b of layer l sits at
``base + (l * blocks + b) * block_bytes``), checks counts and ranges before any
read, and READs straight into the blocks it reserved (``pull_blocks``): neither
side packs or scatters. A read that ends in any way but DONE, or outlives its
deadline, is cancelled before the call returns, so its blocks may be reused; one
that cannot be cancelled is reported as "stuck" and its blocks must stay out of use.

Packed (the conformance suite's interface, and a FaultyBackend-wrapped worker): each
backend owns one nixl agent, made on first use under a unique name (a worker has
one backend, so a process has one agent). The way of a transfer::

    sender                                       receiver
    ------                                       --------
    prepare: register K and V where they lie
      (no copy; ~0.2 ms), payload = agent
      name + metadata for those two regions
      + their descriptors + byte sizes  ───────▶ pull: sizes and descriptors checked
                                                   against meta.layout BEFORE any read
                                                 load the sender's metadata (first
                                                   time: connect to it)
                                                 take a registered staging buffer
                                                 READ both regions, notification =
                                                   transfer id; poll to the deadline
    release (after the receiver's answer         release the transfer handle
      or the lease): drain notifications,        return (K, V), views of the staging
      deregister the two regions                 recycle: staging back to the pool

``close`` (worker shutdown) deregisters everything and drops the agent.

Why register the caller's tensors rather than copy them into a registered pool:
registering measured ~0.2 ms for 16-256 MiB, while copying 128 MiB measured ~26 ms.

Every read has its own deadline: NIXL never times out a read from a frozen peer
(state stays "PROC"); a dead peer fails within milliseconds ("peer_lost").
A READ after ``release`` is not refused on shared memory (the receiver's copy of
the sender's metadata still names the region): release comes only after the
receiver's answer or the lease, which outlives the deadline, so no read is still
running then.

Thread safety: ``pull`` runs on executor threads, several at once. The agent is
made with the readers-writer sync mode (transfers share it, metadata loads take it
alone); this module's own tables sit under one lock.

Where the parts are: this module holds ``NixlBackend``: its tables of regions held and
peers read from, the deadlines, the steps of both ways. ``kv_transfer.nixl_agent`` holds
NIXL itself (loading it, the agent, one READ's wait, the registered cache and staging
buffers, the payloads with their descriptors and checks; ``unavailable_reason`` is
re-exported here). ``kv_transfer.nixl_heads`` reads a share of a block's heads for tensor
parallelism (``pull_heads``'s staged and a-descriptor-a-token ways).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta, check_attachable, contiguous_runs
from kv_transfer.nixl_agent import (
    NixlPayload,
    PagedPayload,
    RegisteredCache,
    RegisteredStaging,
    block_descs,
    check_blocks,
    checked_descs,
    forget_remote,
    is_nixl_error,
    load_nixl,
    make_agent,
    packed_views,
    release_read,
    unavailable_reason,
    wait_for_read,
)
from kv_transfer.nixl_heads import check_heads, head_xfer_descs, pull_staged

__all__ = ["STUCK_GRACE_S", "NixlBackend", "NixlPayload", "PagedPayload", "unavailable_reason"]

READ_TIMEOUT_S = 60.0  # a read's limit when its transfer has no deadline
STUCK_GRACE_S = 5.0  # how long past the deadline pull_async waits for a pull stuck in nixl
REFRESH_AFTER_LOADS = 4096  # remote regions a peer may leave in our agent before a reconnect


@dataclass
class _Peer:
    """A sender this receiver reads from."""

    name: str
    loads: int = 0  # metadata loads since connecting: each leaves its regions in our agent
    inflight: int = 0
    broken: bool = False  # its connection failed: forget it once no read uses it
    loaded: bytes = b""  # the metadata last loaded: a paged cache's is the same every time


class NixlBackend(KVTransferBackend):
    """One worker's NIXL agent and the memory registered with it (the module docstring has both
    ways): paged reads straight between caches, packed transfers for the conformance suite. Made
    by ``TransferConfig.make_backend``; ``close`` deregisters everything."""

    name = "nixl"
    paged = True

    def __init__(self, read_timeout_s: float = READ_TIMEOUT_S, max_staging: int = 8) -> None:
        super().__init__()
        load_nixl()  # fail at worker start, with the install hint, not at the first transfer
        self.read_timeout_s = read_timeout_s
        self._reads_confirmed = 0  # receivers' notifications that a read of ours finished
        self._lock = threading.Lock()
        self._agent_obj = None
        self._regions: dict[str, tuple] = {}  # transfer id -> (registration, k, v), sender side
        self._peers: dict[str, _Peer] = {}
        self._staging = RegisteredStaging(self._agent, max_staging)
        self._cache: RegisteredCache | None = None

    def _agent(self):
        with self._lock:
            if self._agent_obj is None:
                self._agent_obj = make_agent(f"tandem-{uuid.uuid4().hex}")
            return self._agent_obj

    # -- sender ------------------------------------------------------------------

    def prepare(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor) -> NixlPayload:
        agent = self._agent()
        k, v = k.detach().contiguous(), v.detach().contiguous()
        registration = agent.register_memory([k, v])
        try:
            descs = agent.get_serialized_descs(agent.get_xfer_descs([k, v]))
            metadata = agent.get_partial_agent_metadata(registration, inc_conn_info=True)
        except BaseException:
            agent.deregister_memory(registration)
            raise
        with self._lock:
            # The tensors stay referenced while registered: freed memory must not be readable.
            self._regions[meta.transfer_id] = (registration, k, v)
        self._drain_notifications(agent)
        self.stats.sent += 1
        self.stats.bytes_sent += k.nbytes + v.nbytes
        return NixlPayload(agent.name, metadata, descs, (k.nbytes, v.nbytes))

    def release(self, meta: TransferMeta, payload) -> None:
        with self._lock:
            region = self._regions.pop(meta.transfer_id, None)
            agent = self._agent_obj
        if region is not None:
            agent.deregister_memory(region[0])
        if agent is not None:
            self._drain_notifications(agent)

    def _drain_notifications(self, agent) -> None:
        # Notifications pile up in the agent until taken, so every prepare and release takes them.
        count = sum(len(msgs) for msgs in agent.get_new_notifs().values())
        if count:
            with self._lock:
                self._reads_confirmed += count

    def reads_confirmed(self) -> int:
        """Sender: how many of its transfers receivers have reported read (notifications)."""
        if self._agent_obj is not None:
            self._drain_notifications(self._agent_obj)
        return self._reads_confirmed

    # -- paged: both roles register their cache once ------------------------------

    def attach_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        check_attachable(self._cache, k, v)
        agent = self._agent()
        registration = agent.register_memory([k, v])
        metadata = agent.get_partial_agent_metadata(registration, inc_conn_info=True)
        self._cache = RegisteredCache(k, v, registration, metadata)

    def prepare_blocks(self, meta: TransferMeta, block_ids: list[int]) -> PagedPayload:
        cache = self._attached()
        self._drain_notifications(self._agent())
        self.stats.sent += 1
        self.stats.bytes_sent += 2 * len(block_ids) * cache.k.shape[0] * cache.block_bytes
        return self.offer(block_ids)

    def offer(self, block_ids: Sequence[int] = ()) -> PagedPayload:
        """The payload that lets a receiver read ``block_ids`` of the attached cache: all
        but the ids is the same every time (a tensor-parallel worker's rank 0 keeps its other
        ranks' once, and offers their blocks with its own)."""
        cache = self._attached()
        return PagedPayload(
            agent=self._agent().name,
            metadata=cache.metadata,
            base=(cache.k.data_ptr(), cache.v.data_ptr()),
            num_blocks=cache.k.shape[1],
            device=cache.device,
            block_ids=tuple(block_ids),
            heads=cache.k.shape[3],
        )

    def _attached(self) -> RegisteredCache:
        if self._cache is None:
            raise RuntimeError("no paged cache attached (attach_cache)")
        return self._cache

    def close(self) -> None:
        """Deregister every region and idle buffer and drop the agent (worker shutdown)."""
        with self._lock:
            agent, self._agent_obj = self._agent_obj, None
            regions, self._regions = list(self._regions.values()), {}
            peers, self._peers = list(self._peers), {}
            cache, self._cache = self._cache, None
        if agent is None:
            return
        for registration, _, _ in regions:
            agent.deregister_memory(registration)
        if cache is not None:
            agent.deregister_memory(cache.registration)
        self._staging.drop_all(agent)
        for name in peers:
            forget_remote(agent, name)

    @property
    def num_held(self) -> int:
        """Sender: transfers whose regions are still registered."""
        return len(self._regions)

    @property
    def staging_in_use(self) -> int:
        """Receiver: staging buffers lent out and not yet recycled."""
        return self._staging.num_lent

    # -- receiver ----------------------------------------------------------------

    def pull(self, meta: TransferMeta, payload: NixlPayload) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_deadline(meta)
        agent = self._agent()
        remote = checked_descs(agent, meta, payload)
        t0 = time.perf_counter()
        staging = self._staging.take(sum(payload.nbytes))
        try:
            self._read_packed(agent, meta, payload, remote, staging)
        except BaseException:
            self._staging.give(staging)  # ignored when retired by release_read
            raise
        k, v = packed_views(meta, staging, payload.nbytes)
        with self._lock:  # pulls finish on several threads at once
            self.stats.received += 1
            self.stats.bytes_received += k.nbytes + v.nbytes
            self.stats.seconds_receiving += time.perf_counter() - t0
        return k, v

    def recycle(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._staging.give(k)  # K and V share one buffer

    def pull_blocks(self, meta: TransferMeta, payload: PagedPayload, block_ids: list[int]) -> None:
        self.check_deadline(meta)
        cache = self._attached()
        check_blocks(meta, payload, block_ids, cache)
        if payload.heads and payload.heads != cache.k.shape[3]:
            raise TransferError("layout", f"transfer {meta.transfer_id}: the sender's blocks hold {payload.heads} "
                                          f"KV heads, this cache's {cache.k.shape[3]} (read a share: pull_heads)")
        agent = self._agent()
        src_runs, dst_runs = contiguous_runs(list(payload.block_ids), block_ids)
        layers, nbytes = cache.k.shape[0], cache.block_bytes
        remote = agent.get_xfer_descs(
            block_descs(payload.base, payload.num_blocks, layers, nbytes, payload.device, src_runs), cache.mem_type
        )
        local = agent.get_xfer_descs(
            block_descs((cache.k.data_ptr(), cache.v.data_ptr()), cache.k.shape[1], layers, nbytes, cache.device,
                        dst_runs),
            cache.mem_type,
        )
        self._read_into_blocks(agent, meta, payload, local, remote, block_ids, 2 * len(block_ids) * layers * nbytes)

    def _read_into_blocks(self, agent, meta: TransferMeta, payload, local, remote, block_ids: list[int],
                          nbytes: int) -> None:
        """READ ``remote`` into ``local`` (descriptors of ``block_ids`` here) and count it."""
        def unfinished():
            raise TransferError("stuck", f"transfer {meta.transfer_id}: a read into blocks {block_ids} "
                                         "could not be cancelled; they must not be reused")

        self._read_counted(agent, meta, payload, local, remote, nbytes, unfinished)

    def _read_counted(self, agent, meta: TransferMeta, payload, local, remote, nbytes: int, unfinished) -> None:
        """``_read``, and count it."""
        t0 = time.perf_counter()
        self._read(agent, meta, payload, local, remote, unfinished)
        with self._lock:
            self.stats.received += 1
            self.stats.bytes_received += nbytes
            self.stats.seconds_receiving += time.perf_counter() - t0

    async def pull_blocks_async(self, meta: TransferMeta, payload: PagedPayload, block_ids: list[int]) -> None:
        """``pull_blocks`` off the event loop, awaited until it ends (see ``pull_async``):
        the caller may reuse the blocks only once no read can write into them."""
        await self._until_ended(meta, self.pull_blocks, meta, payload, block_ids)

    def pull_heads(
        self, meta: TransferMeta, payload: PagedPayload, block_ids: list[int], src: tuple[int, int],
        dst: tuple[int, int],
    ) -> None:
        """Read KV heads ``src`` (a [start, stop) of the sender's cache's heads) of the
        sender's blocks into heads ``dst`` of ``block_ids`` here: a tensor-parallel rank's
        share of a worker of another size. All the heads of both sides go as whole blocks;
        all the sender's into some of this side's, staged (``kv_transfer.nixl_heads.pull_staged``,
        host memory);
        else a head's row of a token is the longest stretch alike on both sides (``[block,
        token, heads, dim]``), so one descriptor a token, layer and K or V."""
        cache = self._attached()
        check_blocks(meta, payload, block_ids, cache)
        heads = cache.k.shape[3]
        n = check_heads(meta, payload, src, dst, heads)
        if n == payload.heads == heads:
            return self.pull_blocks(meta, payload, block_ids)
        self.check_deadline(meta)
        if n == payload.heads and cache.mem_type == "DRAM":
            return pull_staged(self._agent(), self._staging, self._read_counted, meta, payload, block_ids, dst, cache)
        agent = self._agent()
        local, remote, nbytes = head_xfer_descs(agent, payload, block_ids, src, dst, cache)
        self._read_into_blocks(agent, meta, payload, local, remote, block_ids, nbytes)

    async def pull_heads_async(
        self, meta: TransferMeta, payload: PagedPayload, block_ids: list[int], src: tuple[int, int],
        dst: tuple[int, int],
    ) -> None:
        """``pull_heads`` off the event loop, awaited until it ends (as ``pull_blocks_async``)."""
        await self._until_ended(meta, self.pull_heads, meta, payload, block_ids, src, dst)

    async def pull_async(self, meta: TransferMeta, payload: NixlPayload) -> tuple[torch.Tensor, torch.Tensor]:
        """``pull`` off the event loop, awaited until it ends.

        ``pull`` keeps the deadline itself (it polls, then cancels the read) and reports
        whatever ends after it as a timeout, its staging buffer returned; a result handed
        to a caller that had already given up would hold a buffer nobody recycles. The
        wait here stops only STUCK_GRACE_S past the deadline: a net for a nixl call that
        never returns.
        """
        return await self._until_ended(meta, self.pull, meta, payload)

    async def _until_ended(self, meta: TransferMeta, fn, *args):
        future = self._submit(fn, *args)
        timeout = max(meta.time_left(), 0.0) + STUCK_GRACE_S if meta.deadline else None
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=timeout)
        except asyncio.TimeoutError:
            error = TransferError("stuck", f"transfer {meta.transfer_id} stuck past its deadline")
            error.settled = _settled_when_over(future)
            raise error from None

    def _read_packed(self, agent, meta: TransferMeta, payload: NixlPayload, remote, staging: torch.Tensor) -> None:
        kn = payload.nbytes[0]
        local = agent.get_xfer_descs([staging[:kn], staging[kn : 2 * kn]])
        self._read(agent, meta, payload, local, remote, lambda: self._staging.quarantine(staging))

    def _read(self, agent, meta: TransferMeta, payload, local, remote, unfinished) -> None:
        """READ ``remote`` into ``local``; ``unfinished()`` when a read that did not end
        could not be cancelled either (its destination may still be written)."""
        peer = self._enter(agent, meta, payload)
        broken = False
        try:
            handle = agent.initialize_xfer(
                "READ", local, remote, payload.agent, notif_msg=meta.transfer_id.encode()
            )
            done = False
            try:
                wait_for_read(agent, meta, handle, self.read_timeout_s)
                done = True
            finally:
                release_read(handle, done, unfinished)
        except TransferError as e:
            broken = e.reason in ("peer_lost", "read_failed")
            raise
        except Exception as e:
            if not is_nixl_error(e):
                raise
            broken = True
            reason = "peer_lost" if type(e).__name__ == "nixlRemoteDisconnectError" else "read_failed"
            raise TransferError(reason, f"transfer {meta.transfer_id}: {type(e).__name__}: {e}") from e
        finally:
            self._leave(agent, peer, broken)

    def _enter(self, agent, meta: TransferMeta, payload: NixlPayload) -> _Peer:
        """Load the sender's metadata for this transfer and count the read against it."""
        with self._lock:
            peer = self._peers.setdefault(payload.agent, _Peer(payload.agent))
            if peer.inflight == 0 and peer.loads >= REFRESH_AFTER_LOADS:
                # Loaded regions are never dropped one by one: reconnect to drop them all.
                forget_remote(agent, peer.name)
                peer.loads = 0
            peer.inflight += 1
            known = peer.loaded == payload.metadata
        if known:
            return peer
        try:
            agent.add_remote_agent(payload.metadata)  # merges; connects on first sight
        except Exception as e:
            self._leave(agent, peer, broken=True)
            if not is_nixl_error(e):
                raise
            raise TransferError("peer_lost", f"transfer {meta.transfer_id}: sender unreachable: {e}") from e
        with self._lock:
            peer.loads += 1
            peer.loaded = payload.metadata
        return peer

    def _leave(self, agent, peer: _Peer, broken: bool) -> None:
        with self._lock:
            peer.inflight -= 1
            peer.broken = peer.broken or broken
            if peer.broken and peer.inflight == 0:
                # A failed connection stays failed: drop it, so the next transfer reconnects.
                forget_remote(agent, peer.name)
                if self._peers.get(peer.name) is peer:
                    del self._peers[peer.name]


def _settled_when_over(call: asyncio.Future) -> asyncio.Future:
    """A future done once ``call`` (a read the caller stopped waiting for) has ended with
    its read over: returned, or failed after cancelling it. A call that ends "stuck"
    (its read could not be cancelled) never settles it: the blocks stay quarantined until
    the sender is gone."""
    settled = asyncio.get_running_loop().create_future()

    def over(f: asyncio.Future) -> None:
        error = None if f.cancelled() else f.exception()  # retrieved: no "never retrieved" warning
        if getattr(error, "reason", None) != "stuck" and not settled.done():
            settled.set_result(None)

    call.add_done_callback(over)
    return settled

