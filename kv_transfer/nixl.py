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
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta, check_attachable, contiguous_runs

INSTALL_HINT = (
    "kv transfer backend 'nixl' needs the nixl packages: "
    "pip install 'nixl-cu12==1.5.1' && pip install --no-deps 'nixl==1.5.1' (scripts/install does this)"
)
READ_TIMEOUT_S = 60.0  # a read's limit when its transfer has no deadline
POLL_MAX_S = 0.001  # longest sleep between state checks: 16 MiB reads take ~3-5 ms
STUCK_GRACE_S = 5.0  # how long past the deadline pull_async waits for a pull stuck in nixl
REFRESH_AFTER_LOADS = 4096  # remote regions a peer may leave in our agent before a reconnect
PROGRESS_POLL_US = 1000  # the agent's progress thread wakes on events or after this
_AGENT_CREATION = threading.Lock()  # guards the brief swap of nixl's config class


def load_nixl():
    """The ``nixl._api`` module, or ImportError naming the packages to install."""
    try:
        from nixl import _api
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return _api


def unavailable_reason() -> str | None:
    """Why this process cannot use NIXL, or None when it can (for skips and checks)."""
    try:
        load_nixl()
    except Exception as e:  # a broken native library raises more than ImportError
        return str(e)
    return None


def _nixl_error(e: BaseException) -> bool:
    # The bindings' errors (nixlBackendError, nixlRemoteDisconnectError, ...) share no base class.
    return type(e).__module__.endswith("_bindings") and type(e).__name__.startswith("nixl")


@dataclass(frozen=True)
class NixlPayload:
    """What the receiver needs to read one transfer; small and picklable."""

    agent: str  # the sender's agent name
    metadata: bytes  # its connection info and the two regions of this transfer
    descs: bytes  # serialized descriptors of K and V, in that order
    nbytes: tuple[int, int]  # bytes of K and of V


@dataclass(frozen=True)
class PagedPayload:
    """What the receiver needs to read one prompt's blocks out of the sender's cache."""

    agent: str  # the sender's agent name
    metadata: bytes  # its connection info and its registered cache (the same every time)
    base: tuple[int, int]  # addresses of the sender's paged K and V
    num_blocks: int  # blocks per layer in the sender's cache: the layer stride
    device: int  # the cache's device index (0 for host memory)
    block_ids: tuple[int, ...]  # the prompt's blocks, in prompt order
    heads: int = 0  # KV heads a token holds in the sender's cache (a rank's share at tensor_parallel_size > 1)


@dataclass(frozen=True)
class _Cache:
    """A worker's paged K and V, registered once."""

    k: torch.Tensor
    v: torch.Tensor
    registration: object = field(repr=False)
    metadata: bytes = field(repr=False)

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.k.is_cuda else "DRAM"

    @property
    def device(self) -> int:
        return (self.k.device.index or 0) if self.k.is_cuda else 0

    @property
    def block_bytes(self) -> int:
        return self.k[0, 0].numel() * self.k.element_size()


def block_descs(base: tuple[int, int], num_blocks: int, layers: int, block_bytes: int, device: int,
                runs: np.ndarray) -> np.ndarray:
    """Nx3 (address, length, device) rows for ``runs`` of blocks in every layer of K then V.

    ``runs``: (first block, number of blocks) rows. The cache is ``[layers, num_blocks,
    ...]``, so block ``b`` of layer ``l`` starts at ``base + (l * num_blocks + b) * block_bytes``.
    """
    layer_starts = np.arange(layers, dtype=np.int64)[:, None] * num_blocks  # [L, 1]
    starts = (layer_starts + runs[None, :, 0]) * block_bytes  # [L, R] offsets
    lengths = np.broadcast_to(runs[None, :, 1] * block_bytes, starts.shape)
    rows = []
    for addr in base:
        rows.append(np.stack([addr + starts, lengths, np.full_like(starts, device)], axis=-1).reshape(-1, 3))
    return np.concatenate(rows)


def head_descs(base: tuple[int, int], num_blocks: int, layers: int, block_size: int, heads: int, head_bytes: int,
               device: int, block_ids: Sequence[int], head_range: tuple[int, int]) -> np.ndarray:
    """Nx3 (address, length, device) rows for heads ``head_range`` of every token of
    ``block_ids`` in every layer of K then V, in (K/V, layer, block, token) order. A token of
    block ``b`` in layer ``l`` starts at ``((l * num_blocks + b) * block_size + t) * heads *
    head_bytes`` past the base; its heads lie one after another."""
    token_bytes = heads * head_bytes
    layer = np.arange(layers, dtype=np.int64)[:, None, None]
    block = np.asarray(block_ids, dtype=np.int64)[None, :, None]
    token = np.arange(block_size, dtype=np.int64)[None, None, :]
    starts = ((layer * num_blocks + block) * block_size + token) * token_bytes + head_range[0] * head_bytes
    length = (head_range[1] - head_range[0]) * head_bytes
    rows = [np.stack([addr + starts, np.full_like(starts, length), np.full_like(starts, device)], axis=-1)
            for addr in base]
    return np.concatenate([r.reshape(-1, 3) for r in rows])


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
        self._staging = _RegisteredStaging(self._agent, max_staging)
        self._cache: _Cache | None = None

    def _agent(self):
        with self._lock:
            if self._agent_obj is None:
                self._agent_obj = _make_agent(f"tandem-{uuid.uuid4().hex}")
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
        self._cache = _Cache(k, v, registration, metadata)

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

    def _attached(self) -> _Cache:
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
            _forget(agent, name)

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
        remote = self._checked_descs(agent, meta, payload)
        t0 = time.perf_counter()
        staging = self._staging.take(sum(payload.nbytes))
        try:
            self._read_packed(agent, meta, payload, remote, staging)
        except BaseException:
            self._staging.give(staging)  # ignored when retired by _release
            raise
        k, v = _views(meta, staging, payload.nbytes)
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
        self._check_blocks(meta, payload, block_ids, cache)
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

    def _pull_staged(self, meta: TransferMeta, payload: PagedPayload, block_ids: list[int], dst: tuple[int, int],
                     cache: _Cache) -> None:
        """Every head of the sender's blocks, which this side needs all of, into a registered
        staging buffer a stretch of blocks a descriptor (as between equal sizes), then copied
        into heads ``dst`` of ``block_ids``: a descriptor a token would cost more than the copy.
        A read that cannot be cancelled keeps only the staging buffer out of use."""
        agent = self._agent()
        layers, block_size, head_dim = cache.k.shape[0], cache.k.shape[2], cache.k.shape[4]
        block_bytes = block_size * payload.heads * head_dim * cache.k.element_size()
        src_runs, _ = contiguous_runs(list(payload.block_ids), list(range(len(block_ids))))
        remote_rows = block_descs(payload.base, payload.num_blocks, layers, block_bytes, payload.device, src_runs)
        nbytes = int(remote_rows[:, 1].sum())
        staging = self._staging.take(nbytes)
        starts = staging.data_ptr() + np.concatenate([[0], np.cumsum(remote_rows[:-1, 1])])
        local_rows = np.stack([starts, remote_rows[:, 1], np.zeros_like(starts)], axis=-1)
        try:  # a quarantined buffer is not given back
            self._read_counted(agent, meta, payload, agent.get_xfer_descs(local_rows, "DRAM"),
                               agent.get_xfer_descs(remote_rows, "DRAM"), nbytes,
                               lambda: self._staging.quarantine(staging))
            both = staging.view(cache.k.dtype).view(2, layers, len(block_ids), block_size, payload.heads, head_dim)
            index = torch.as_tensor(block_ids, dtype=torch.long)
            cache.k[:, index, :, dst[0] : dst[1]] = both[0]
            cache.v[:, index, :, dst[0] : dst[1]] = both[1]
        finally:
            self._staging.give(staging)

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
        all the sender's into some of this side's, staged (``_pull_staged``, host memory);
        else a head's row of a token is the longest stretch alike on both sides (``[block,
        token, heads, dim]``), so one descriptor a token, layer and K or V."""
        cache = self._attached()
        self._check_blocks(meta, payload, block_ids, cache)
        heads = cache.k.shape[3]
        n = src[1] - src[0]
        if not (0 <= src[0] < src[1] <= payload.heads and 0 <= dst[0] and dst[0] + n == dst[1] <= heads):
            raise TransferError("layout", f"transfer {meta.transfer_id}: heads {src} of the sender's "
                                          f"{payload.heads} do not fit heads {dst} of this cache's {heads}")
        if n == payload.heads == heads:
            return self.pull_blocks(meta, payload, block_ids)
        self.check_deadline(meta)
        if n == payload.heads and cache.mem_type == "DRAM":
            return self._pull_staged(meta, payload, block_ids, dst, cache)
        agent = self._agent()
        layers, block_size, head_bytes = cache.k.shape[0], cache.k.shape[2], cache.k[0, 0, 0, 0].nbytes
        remote = agent.get_xfer_descs(head_descs(
            payload.base, payload.num_blocks, layers, block_size, payload.heads, head_bytes, payload.device,
            payload.block_ids, src), cache.mem_type)
        local = agent.get_xfer_descs(head_descs(
            (cache.k.data_ptr(), cache.v.data_ptr()), cache.k.shape[1], layers, block_size, heads, head_bytes,
            cache.device, block_ids, dst), cache.mem_type)
        nbytes = 2 * len(block_ids) * layers * block_size * n * head_bytes
        self._read_into_blocks(agent, meta, payload, local, remote, block_ids, nbytes)

    async def pull_heads_async(
        self, meta: TransferMeta, payload: PagedPayload, block_ids: list[int], src: tuple[int, int],
        dst: tuple[int, int],
    ) -> None:
        """``pull_heads`` off the event loop, awaited until it ends (as ``pull_blocks_async``)."""
        await self._until_ended(meta, self.pull_heads, meta, payload, block_ids, src, dst)

    @staticmethod
    def _check_blocks(meta: TransferMeta, payload, block_ids: list[int], cache: _Cache) -> None:
        """The offer fits this transfer and this cache; nothing is read before."""
        if not isinstance(payload, PagedPayload):
            kind = type(payload).__name__
            raise TransferError("layout", f"transfer {meta.transfer_id}: not a paged nixl payload ({kind})")
        counts = {len(payload.block_ids), len(block_ids)}
        if counts != {meta.num_blocks}:
            raise TransferError(
                "layout",
                f"transfer {meta.transfer_id}: {len(payload.block_ids)} blocks offered and "
                f"{len(block_ids)} reserved for a transfer of {meta.num_blocks}",
            )
        if meta.num_blocks and not 0 <= min(payload.block_ids) <= max(payload.block_ids) < payload.num_blocks:
            raise TransferError("layout", f"transfer {meta.transfer_id}: block ids outside the sender's cache")
        if meta.num_blocks and not 0 <= min(block_ids) <= max(block_ids) < cache.k.shape[1]:
            raise TransferError("layout", f"transfer {meta.transfer_id}: block ids outside this cache")

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

    def _checked_descs(self, agent, meta: TransferMeta, payload) -> object:
        """The sender's descriptors, once they match the layout; nothing is read before."""
        if not isinstance(payload, NixlPayload):
            kind = type(payload).__name__
            raise TransferError("layout", f"transfer {meta.transfer_id}: not a nixl payload ({kind})")
        expected = meta.layout.nbytes(meta.num_blocks)
        if list(payload.nbytes) != [expected // 2] * 2:
            raise TransferError(
                "layout",
                f"transfer {meta.transfer_id}: sender offers K+V of {payload.nbytes} bytes, "
                f"{meta.num_blocks} blocks of {meta.layout} need {expected // 2} each",
            )
        descs = agent.deserialize_descs(payload.descs)
        # Indexing past descCount() returns garbage instead of raising: count first.
        lengths = [descs[i][1] for i in range(descs.descCount())] if descs.descCount() == 2 else []
        if lengths != list(payload.nbytes):
            raise TransferError(
                "layout", f"transfer {meta.transfer_id}: descriptors {lengths} disagree with sizes {payload.nbytes}"
            )
        return descs

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
                self._wait(agent, meta, handle)
                done = True
            finally:
                self._release(handle, done, unfinished)
        except TransferError as e:
            broken = e.reason in ("peer_lost", "read_failed")
            raise
        except Exception as e:
            if not _nixl_error(e):
                raise
            broken = True
            reason = "peer_lost" if type(e).__name__ == "nixlRemoteDisconnectError" else "read_failed"
            raise TransferError(reason, f"transfer {meta.transfer_id}: {type(e).__name__}: {e}") from e
        finally:
            self._leave(agent, peer, broken)

    @staticmethod
    def _release(handle, done: bool, unfinished) -> None:
        try:
            handle.release()  # cancels a read still running
        except Exception:
            if not done:
                unfinished()  # the read may still write into its destination

    def _wait(self, agent, meta: TransferMeta, handle) -> None:
        limit = time.time() + self.read_timeout_s
        deadline = min(meta.deadline, limit) if meta.deadline else limit
        state, delay = agent.transfer(handle), 1e-4
        while state == "PROC":
            if time.time() > deadline:
                raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline mid-read")
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError("read_failed", f"transfer {meta.transfer_id}: read ended in state {state}")
        if meta.deadline and time.time() > meta.deadline:
            # Whoever awaited this has given up and will not recycle the staging buffer.
            raise TransferError("timeout", f"transfer {meta.transfer_id} finished after its deadline")

    def _enter(self, agent, meta: TransferMeta, payload: NixlPayload) -> _Peer:
        """Load the sender's metadata for this transfer and count the read against it."""
        with self._lock:
            peer = self._peers.setdefault(payload.agent, _Peer(payload.agent))
            if peer.inflight == 0 and peer.loads >= REFRESH_AFTER_LOADS:
                # Loaded regions are never dropped one by one: reconnect to drop them all.
                _forget(agent, peer.name)
                peer.loads = 0
            peer.inflight += 1
            known = peer.loaded == payload.metadata
        if known:
            return peer
        try:
            agent.add_remote_agent(payload.metadata)  # merges; connects on first sight
        except Exception as e:
            self._leave(agent, peer, broken=True)
            if not _nixl_error(e):
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
                _forget(agent, peer.name)
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


def _make_agent(name: str):
    """A UCX agent whose progress thread sleeps between events.

    nixl's Python wrapper hard-codes the progress thread's poll timeout to 0, so the
    thread spins: a full core per process when idle (measured 2.6 CPU-seconds in 3 s).
    The sender needs that thread (a READ completes only when the sender's side takes
    the notification), so it stays, with a 1 ms timeout: idle cost ~1% of a core, a
    small READ with notification 0.08 ms median (0.12 ms spinning). The wrapper gives
    no setting for it, so the config class it instantiates is swapped for the call.
    """
    api = load_nixl()
    bind, base = api.nixlBind, api.nixlBind.nixlAgentConfig

    class Config(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):
            base.pthrDelay.__set__(self, max(value, PROGRESS_POLL_US))

    config = api.nixl_agent_config(backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    with _AGENT_CREATION:
        bind.nixlAgentConfig = Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


def _forget(agent, name: str) -> None:
    try:
        agent.remove_remote_agent(name)
    except Exception as e:
        if not _nixl_error(e):
            raise  # not found is fine: a failed first load leaves nothing behind


def _views(meta: TransferMeta, staging: torch.Tensor, nbytes: tuple[int, int]):
    dtype = getattr(torch, meta.layout.dtype)
    shape = meta.layout.packed_shape(meta.num_blocks)
    kn = nbytes[0]
    return staging[:kn].view(dtype).view(shape), staging[kn : 2 * kn].view(dtype).view(shape)


@dataclass
class _Buffer:
    tensor: torch.Tensor
    registration: object = field(repr=False)


class _RegisteredStaging:
    """Receive buffers registered with the agent once and reused, smallest fit first.

    Registering is cheap, but a fresh buffer costs a page fault per 4 KiB on its first
    read, which measured slower than the read itself. Keeps at most ``max_free`` idle.
    """

    def __init__(self, agent_fn, max_free: int) -> None:
        self._agent_fn = agent_fn
        self.max_free = max_free
        self._lock = threading.Lock()
        self._free: list[_Buffer] = []
        self._lent: dict[int, _Buffer] = {}  # storage address -> buffer
        self._quarantined: list[_Buffer] = []

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.tensor.numel() >= nbytes]
            # Among equal fits the latest returned: its pages are likeliest still in cache.
            best = min(fits, key=lambda i: (self._free[i].tensor.numel(), -i), default=None)
            buf = self._free.pop(best) if best is not None else None
        if buf is None:
            tensor = torch.zeros(max(nbytes, 1), dtype=torch.uint8)  # zeros: touch the pages now
            buf = _Buffer(tensor, self._agent_fn().register_memory(tensor))
        with self._lock:
            self._lent[buf.tensor.data_ptr()] = buf
        return buf.tensor[:nbytes]

    def give(self, view: torch.Tensor) -> None:
        """Return the buffer ``view`` lies in; views of unknown memory are ignored."""
        with self._lock:
            buf = self._lent.pop(view.untyped_storage().data_ptr(), None)
            if buf is None:
                return
            self._free.append(buf)
            evicted = None
            if len(self._free) > self.max_free:
                smallest = min(range(len(self._free)), key=lambda i: self._free[i].tensor.numel())
                evicted = self._free.pop(smallest)
        if evicted is not None:
            self._agent_fn().deregister_memory(evicted.registration)

    def drop_all(self, agent) -> None:
        """Deregister the idle buffers and forget every buffer: lent ones, registered with
        this agent, must not come back into a pool that a new agent will use."""
        with self._lock:
            free, self._free, self._lent = self._free, [], {}
        for buf in free:
            agent.deregister_memory(buf.registration)

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    def quarantine(self, view: torch.Tensor) -> None:
        with self._lock:
            buf = self._lent.pop(view.untyped_storage().data_ptr(), None)
            if buf is not None:
                self._quarantined.append(buf)
