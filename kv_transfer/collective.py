"""Collective backend: a two-rank channel per sender-receiver pair, made on first use.

Every receiving process hosts a small rendezvous store (``endpoint``, "host:port",
published in its reservations). A sender that first pushes to an endpoint and the
receiver that first pulls from that sender both build the pair's channel, a
``torch.distributed.ProcessGroupGloo`` of two ranks (sender 0, receiver 1) keyed by
the sender's id and an epoch; no process joins any group wider than a pair, so a
worker joining, leaving or dying touches only its own channels and transfers between
other pairs never pause.

Each transfer has its own message tags on its channel (allocated by the sender, sent in
the payload), so a receive can only match the send of the same transfer: transfers of
one pair may run in any order and concurrently, and one that gives up cannot shift
another's bytes. A transfer is three messages: a fixed-size header (transfer id, block
count, layout, byte counts), then K, then V. The receiver takes the header first and
posts the K and V receives only when it matches what it expects, so no byte lands for
a transfer that is not the one announced, and a receive never meets a larger message
(gloo aborts the process on that).

A channel that fails (peer gone, deadline passed, receiver refused) is closed on the
side that saw it, which makes the peer's pending operations on it fail too; the
sender then moves to the next epoch, and the receiver refuses payloads of an epoch it
has closed. The next transfer builds a fresh channel; nothing else is touched.

Channel lifecycle (sender view)::

    first push to endpoint ─▶ build(epoch) ─▶ open ─▶ send, send, ... ─▶ a failure
       ─▶ close, epoch += 1 ─▶ next push builds(epoch) ...

On CPUs the backend is paged: each worker attaches its paged cache, and a transfer goes
from the sender's blocks straight into the receiver's reserved ones, with neither a
gather on one side nor a scatter on the other. The cache is ``[layers, blocks, ...]``,
so one layer's stretch of blocks that are consecutive on both sides is one contiguous
region at each end, and one message: a transfer is the header, then per layer one
message per such stretch of K, then the same for V. Both sides derive that split from
the same two block lists (the sender's in the payload, the receiver's in
``TransferMeta.dst_blocks``), and the header carries a hash of both, so a receive never
meets a message of another size. Blocks so scattered that the split would pass
``MAX_MESSAGES`` go packed instead (gathered, sent as one K and one V, scattered).

On GPUs gloo's tensors are staged through host memory, so the backend moves packed KV
there (a pairwise NCCL channel is the next step for GPU pools); packed K and V arrive
in staging buffers that are kept and reused (``recycle``): fresh ones cost a page fault
per 4 KiB, which measured slower than the transfer itself.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field

import torch

from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta, check_attachable, contiguous_runs


def advertised_host() -> str:
    """The address peers reach this process at: the Ray node's, or loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray worker
        pass
    return "127.0.0.1"


HEADER_MAGIC = 0x54414E44454D  # "TANDEM"
TAGS_PER_TRANSFER = 4  # packed: header, K, V, and one spare
# A paged transfer goes as one message per layer and stretch of consecutive blocks (K
# and V) when that makes at most MAX_MESSAGES, or messages of MIN_MESSAGE_BYTES or more;
# else packed. Measured here: some 50 us a message, against a gather and a scatter at
# about 3 GB/s each, so small messages lose to two copies once they are many.
MAX_MESSAGES = 512
MIN_MESSAGE_BYTES = 64 << 10


def transfer_header(meta: TransferMeta, nbytes_k: int, nbytes_v: int, blocks: tuple = (), messages: int = 2) -> torch.Tensor:
    """What the sender says it sends; the receiver compares it with its own view first.

    ``blocks``: a paged transfer's block lists (sender's, receiver's), which fix its split."""
    ident = zlib.crc32(f"{meta.transfer_id}|{meta.request_id}|{meta.layout}|{blocks}".encode())
    return torch.tensor([HEADER_MAGIC, ident, meta.num_blocks, nbytes_k, nbytes_v, messages, 0, 0], dtype=torch.int64)


class BlockPlan:
    """How a paged transfer's bytes travel, as both sides derive it from the two block
    lists: per layer one message per stretch of blocks consecutive on both sides (K, then
    V), or, when those would be many and small, one packed K and one packed V."""

    def __init__(self, src: list[int], dst: list[int], k_cache: torch.Tensor) -> None:
        self.src, self.dst = list(src), list(dst)
        self.src_runs, self.dst_runs = contiguous_runs(self.src, self.dst) if src else ((), ())
        self.nbytes = len(self.src) * k_cache[:, 0].numel() * k_cache.element_size()  # of K, and of V
        messages = 2 * k_cache.shape[0] * len(self.src_runs)
        self.direct = messages <= MAX_MESSAGES or 2 * self.nbytes >= messages * MIN_MESSAGE_BYTES
        self.num_messages = messages if self.direct else 2

    def header(self, meta: TransferMeta) -> torch.Tensor:
        return transfer_header(meta, self.nbytes, self.nbytes, (tuple(self.src), tuple(self.dst)), self.num_messages)

    def regions(self, k_cache: torch.Tensor, v_cache: torch.Tensor, side: str) -> list[torch.Tensor]:
        """The direct messages' regions of this side's cache (``side``: "src" or "dst")."""
        runs = self.src_runs if side == "src" else self.dst_runs
        return [
            _host_bytes(cache[layer, first : first + count])
            for cache in (k_cache, v_cache) for layer in range(cache.shape[0]) for first, count in runs.tolist()
        ]


class Channel:
    """One two-rank gloo group between a sender (rank 0) and a receiver (rank 1)."""

    def __init__(self, store, prefix: str, rank: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        # Blocks until the peer builds its side too (or raises at the timeout).
        self._pg = ProcessGroupGloo(PrefixStore(prefix, store), rank, 2, datetime.timedelta(seconds=timeout_s))
        self.peer = 1 - rank
        self.closed = False
        self._closing = threading.Lock()

    def exchange(self, op: str, tensors: list[torch.Tensor], first_tag: int, timeout_s: float) -> None:
        """Send or receive ``tensors`` under consecutive tags, all posted before any wait."""
        pg = self._pg
        if self.closed or pg is None:
            raise TransferError("channel_closed", "the channel was closed")
        post = pg.send if op == "send" else pg.recv
        works = [post([t], self.peer, first_tag + i) for i, t in enumerate(tensors)]
        deadline = time.monotonic() + timeout_s
        for w in works:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError("timeout", f"{op} passed its deadline")
            w.wait(datetime.timedelta(seconds=left))

    def close(self) -> None:
        """Fail pending operations here; dropping the group closes the peer's sockets.

        Once it returns (on any thread that called it), no receive posted on the channel
        writes another byte: gloo closes the pairs under the locks their reads hold."""
        self.closed = True
        with self._closing:
            pg, self._pg = self._pg, None
            if pg is not None:
                pg.abort()


@dataclass
class _Outgoing:
    """The sender's state towards one receiver endpoint."""

    epoch: int = 0
    channel: Channel | None = None
    next_tag: int = 0  # each transfer takes tags from here on (``take_tags``)
    lock: threading.Lock = field(default_factory=threading.Lock)  # serializes building
    tag_lock: threading.Lock = field(default_factory=threading.Lock)  # never held while building

    def take_tags(self, count: int) -> int:
        """Tags for one transfer; called on the event loop, so never behind a build."""
        with self.tag_lock:
            first, self.next_tag = self.next_tag, self.next_tag + count
        return first


class CollectiveBackend(KVTransferBackend):
    name = "collective"
    sends = True

    def __init__(self, op_timeout_s: float = 60.0, connect_timeout_s: float = 30.0) -> None:
        super().__init__()
        # On GPUs the bytes go through host memory: gloo moves CPU tensors, packed.
        self.on_gpu = torch.cuda.is_available()
        self.paged = not self.on_gpu
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.sender_id = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._out: dict[str, _Outgoing] = {}  # receiver endpoint -> state
        self._in: dict[tuple[str, int], Channel] = {}  # (sender id, epoch) -> channel
        self._in_building: dict[tuple[str, int], threading.Lock] = {}
        self._closed_in: set[tuple[str, int]] = set()
        self._store = None
        self._endpoint = ""
        self._staging = StagingPool()

    # -- the receiver's rendezvous point ------------------------------------------

    @property
    def endpoint(self) -> str:
        """Where senders reach this process ("host:port"); the store starts on first use."""
        with self._lock:
            if self._store is None:
                from torch.distributed import TCPStore

                self._store = TCPStore(
                    "0.0.0.0", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=self.connect_timeout_s),
                )
                self._endpoint = f"{advertised_host()}:{self._store.port}"
            return self._endpoint

    @property
    def num_channels(self) -> int:
        with self._lock:
            return sum(o.channel is not None for o in self._out.values()) + len(self._in)

    # -- sender ---------------------------------------------------------------------

    def prepare(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor) -> dict:
        if not meta.dst_endpoint:
            raise TransferError("no_endpoint", "the receiver published no transfer endpoint")
        expected = meta.layout.nbytes(meta.num_blocks)
        if k.nbytes + v.nbytes != expected:
            raise TransferError("layout", f"KV holds {k.nbytes + v.nbytes} bytes, its layout says {expected}")
        out = self._outgoing(meta.dst_endpoint)
        return {"sender": self.sender_id, "epoch": out.epoch, "tag": out.take_tags(TAGS_PER_TRANSFER)}

    def _outgoing(self, endpoint: str) -> _Outgoing:
        with self._lock:
            return self._out.setdefault(endpoint, _Outgoing())

    def push(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor, payload: dict) -> None:
        t0 = time.perf_counter()
        out = self._outgoing(meta.dst_endpoint)
        channel = self._send_channel(meta.dst_endpoint, out, meta, payload["epoch"])
        if "blocks" in payload:  # paged: out of this worker's blocks
            messages, nbytes = self._push_blocks(meta, payload)
        else:
            messages = [transfer_header(meta, k.nbytes, v.nbytes), _host_bytes(k), _host_bytes(v)]
            nbytes = k.nbytes + v.nbytes
        try:
            channel.exchange("send", messages, payload["tag"], self._op_timeout(meta))
        except Exception as e:
            self._drop_outgoing(out, payload["epoch"])
            raise _as_transfer_error(e) from e
        self.stats.sent += 1
        self.stats.bytes_sent += nbytes
        self.stats.seconds_sending += time.perf_counter() - t0

    def _send_channel(self, endpoint: str, out: _Outgoing, meta: TransferMeta, epoch: int) -> Channel:
        """The channel to ``endpoint`` on ``epoch``, built if need be within the transfer's
        time (a receiver that gave up or died fails it by then, not 30 s later)."""
        with out.lock:
            if out.epoch != epoch:
                raise TransferError("channel_closed", "the channel this transfer was prepared on closed")
            if out.channel is None:
                timeout_s = self._connect_timeout(meta)
                if timeout_s <= 0:
                    out.epoch += 1  # the receiver may have given up on building this one
                    raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")
                host, port = endpoint.rsplit(":", 1)
                try:
                    store = _client(host, int(port), timeout_s)
                    out.channel = Channel(store, f"{self.sender_id}/{epoch}", 0, timeout_s)
                except Exception as e:
                    out.epoch += 1  # a half-built rendezvous must not be joined again
                    raise TransferError("connect", f"no channel to {endpoint}: {e}") from e
            return out.channel

    def _drop_outgoing(self, out: _Outgoing, epoch: int) -> None:
        with out.lock:
            if out.epoch == epoch:
                if out.channel is not None:
                    out.channel.close()
                out.channel = None
                out.epoch += 1

    def abandon(self, meta: TransferMeta, payload: dict) -> None:
        """The receiver gave up on this transfer: close its channel, so the send fails now."""
        self._drop_outgoing(self._outgoing(meta.dst_endpoint), payload["epoch"])

    # -- paged: from the sender's blocks into the receiver's ---------------------------

    def attach_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        check_attachable(self._cache, k, v)
        self._cache = (k, v)

    def _attached(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None:
            raise RuntimeError("no paged cache attached (attach_cache)")
        return self._cache

    def prepare_blocks(self, meta: TransferMeta, block_ids: list[int]) -> dict:
        """The offer of these blocks; ``meta.dst_blocks`` must name the receiver's."""
        if not meta.dst_endpoint:
            raise TransferError("no_endpoint", "the receiver published no transfer endpoint")
        if len(meta.dst_blocks) != len(block_ids):
            raise TransferError(
                "layout", f"transfer {meta.transfer_id}: {len(block_ids)} blocks offered for "
                          f"{len(meta.dst_blocks)} receiving blocks",
            )
        plan = BlockPlan(block_ids, list(meta.dst_blocks), self._attached()[0])
        out = self._outgoing(meta.dst_endpoint)
        return {"sender": self.sender_id, "epoch": out.epoch, "tag": out.take_tags(1 + plan.num_messages),
                "blocks": tuple(block_ids)}

    def _push_blocks(self, meta: TransferMeta, payload: dict) -> tuple[list[torch.Tensor], int]:
        """The sender's messages of a paged transfer (header first) and their bytes."""
        k_cache, v_cache = self._attached()
        plan = BlockPlan(list(payload["blocks"]), list(meta.dst_blocks), k_cache)
        if plan.direct:
            body = plan.regions(k_cache, v_cache, "src")
        else:
            index = torch.tensor(plan.src)
            body = [_host_bytes(k_cache[:, index]), _host_bytes(v_cache[:, index])]
        return [plan.header(meta), *body], sum(t.nbytes for t in body)

    def pull_blocks(self, meta: TransferMeta, payload: dict, block_ids: list[int]) -> None:
        t0 = time.perf_counter()
        self.check_deadline(meta)
        k_cache, v_cache = self._attached()
        self._check_offer(meta, payload, block_ids, k_cache.shape[1])
        if not block_ids:
            return
        plan = BlockPlan(list(payload["blocks"]), block_ids, k_cache)
        expected = plan.header(meta)
        if plan.direct:
            body = plan.regions(k_cache, v_cache, "dst")
        else:
            shape = (k_cache.shape[0], len(block_ids), *k_cache.shape[2:])
            body = [_host_bytes(self._staging.take(shape, k_cache.dtype, "cpu")) for _ in range(2)]
        key = (payload["sender"], payload["epoch"])
        channel = self._recv_channel(key, meta)
        try:
            self._receive_checked(channel, meta, payload["tag"], expected, body)
        except Exception as e:
            # Closed, the channel writes nothing more into the blocks (or staging buffers).
            self._drop_incoming(key)
            channel.close()
            raise _as_transfer_error(e) from e
        if not plan.direct:
            index = torch.tensor(block_ids)
            for cache, staged in zip((k_cache, v_cache), body):
                cache[:, index] = staged.view(k_cache.dtype).view(shape)
                self._staging.give(staged)
        self.stats.received += 1
        self.stats.bytes_received += sum(t.nbytes for t in body)
        self.stats.seconds_receiving += time.perf_counter() - t0

    async def push_async(self, meta: TransferMeta, k, v, payload: dict) -> None:
        """``push`` off the event loop. A paged push reads the sender's blocks, which are
        freed once it returns: it is awaited to its end (its sends have the transfer's
        deadline, and one that fails closes the channel, so no later byte can reach the
        receiver), never given up on while it may still read them."""
        if "blocks" in payload:
            await self._submit(self.push, meta, k, v, payload)
        else:
            await super().push_async(meta, k, v, payload)

    async def pull_blocks_async(self, meta: TransferMeta, payload: dict, block_ids: list[int]) -> None:
        """``pull_blocks`` off the event loop, awaited to its end: its receives have the
        transfer's deadline, and the caller may reuse the blocks only once none can write."""
        await self._submit(self.pull_blocks, meta, payload, block_ids)

    @staticmethod
    def _check_offer(meta: TransferMeta, payload, block_ids: list[int], num_blocks: int) -> None:
        """The offer fits this transfer and this cache; nothing is received before."""
        if not isinstance(payload, dict) or "blocks" not in payload:
            raise TransferError("layout", f"transfer {meta.transfer_id}: not a paged collective payload")
        if {len(payload["blocks"]), len(block_ids)} != {meta.num_blocks}:
            raise TransferError(
                "layout", f"transfer {meta.transfer_id}: {len(payload['blocks'])} blocks offered and "
                          f"{len(block_ids)} reserved for a transfer of {meta.num_blocks}",
            )
        if tuple(block_ids) != tuple(meta.dst_blocks):
            raise TransferError(
                "layout", f"transfer {meta.transfer_id}: sent for blocks {list(meta.dst_blocks)}, "
                          f"reserved {list(block_ids)}",
            )
        if block_ids and not 0 <= min(block_ids) <= max(block_ids) < num_blocks:
            raise TransferError("layout", f"transfer {meta.transfer_id}: block ids outside this cache")

    # -- receiver -------------------------------------------------------------------

    def _receive_checked(self, channel: Channel, meta: TransferMeta, tag: int, expected: torch.Tensor,
                         body: list[torch.Tensor]) -> None:
        """The header first; the body's receives are posted only once it matches."""
        header = torch.zeros_like(expected)
        channel.exchange("recv", [header], tag, self._op_timeout(meta))
        if not torch.equal(header, expected):
            raise TransferError(
                "header", f"transfer {meta.transfer_id}: header mismatch, the sender announced {header.tolist()}, "
                f"expected {expected.tolist()} (id hash, blocks, K bytes, V bytes, messages)",
            )
        channel.exchange("recv", body, tag + 1, self._op_timeout(meta))

    def pull(self, meta: TransferMeta, payload: dict) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        self.check_deadline(meta)
        key = (payload["sender"], payload["epoch"])
        channel = self._recv_channel(key, meta)
        dtype = getattr(torch, meta.layout.dtype)
        shape = meta.layout.packed_shape(meta.num_blocks)
        k = self._staging.take(shape, dtype, "cpu")
        v = self._staging.take(shape, dtype, "cpu")
        expected = transfer_header(meta, k.nbytes, v.nbytes)
        try:
            self._receive_checked(channel, meta, payload["tag"], expected, [_host_bytes(k), _host_bytes(v)])
        except Exception as e:
            # A receive that gave up may still be posted: the buffers stay out of the pool.
            self._drop_incoming(key)
            raise _as_transfer_error(e) from e
        self.stats.received += 1
        self.stats.bytes_received += k.nbytes + v.nbytes
        self.stats.seconds_receiving += time.perf_counter() - t0
        if self.on_gpu:
            k, v = k.cuda(non_blocking=True), v.cuda(non_blocking=True)
        return k, v

    def _recv_channel(self, key: tuple[str, int], meta: TransferMeta) -> Channel:
        """The channel from this sender and epoch, built if need be within the transfer's
        time: a sender that died before building its side fails the transfer by its
        deadline, and every transfer waiting on the same build fails with it."""
        sender, epoch = key
        store = self._store_or_fail()
        with self._lock:
            if key in self._closed_in:
                raise TransferError("channel_closed", "the channel this transfer was prepared on closed")
            # A newer epoch from the same sender means it has given up on the older ones.
            for old in [k for k in self._in if k[0] == sender and k[1] < epoch]:
                self._closed_in.add(old)
                self._in.pop(old).close()
            building = self._in_building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                if key in self._in:
                    return self._in[key]
                if key in self._closed_in:  # its build failed while this transfer waited
                    raise TransferError("channel_closed", f"no channel from {sender}: its build failed")
            timeout_s = self._connect_timeout(meta)
            try:
                if timeout_s <= 0:
                    raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")
                channel = Channel(_client("127.0.0.1", store.port, timeout_s), f"{sender}/{epoch}", 1, timeout_s)
            except Exception as e:
                with self._lock:
                    self._closed_in.add(key)
                    self._in_building.pop(key, None)
                if isinstance(e, TransferError):
                    raise
                raise TransferError("connect", f"no channel from {sender}: {e}") from e
            with self._lock:
                self._in[key] = channel
                self._in_building.pop(key, None)
            return channel

    def _store_or_fail(self):
        if self._store is None:
            raise TransferError("no_endpoint", "this process published no transfer endpoint")
        return self._store

    def _drop_incoming(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._closed_in.add(key)
            channel = self._in.pop(key, None)
        if channel is not None:
            channel.close()

    def recycle(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.device.type == "cpu":
            self._staging.give(k)
            self._staging.give(v)

    def close(self) -> None:
        """Close every channel (worker shutdown)."""
        with self._lock:
            channels = [o.channel for o in self._out.values() if o.channel] + list(self._in.values())
            self._out.clear()
            self._in.clear()
        for c in channels:
            c.close()

    def _connect_timeout(self, meta: TransferMeta) -> float:
        return min(self.connect_timeout_s, meta.time_left()) if meta.deadline else self.connect_timeout_s

    def _op_timeout(self, meta: TransferMeta) -> float:
        return min(self.op_timeout_s, meta.time_left()) if meta.deadline else self.op_timeout_s


def _client(host: str, port: int, timeout_s: float):
    """A client of a rendezvous store whose waits end at ``timeout_s``: one per channel
    build, as each has its own deadline."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def _as_transfer_error(e: Exception) -> TransferError:
    if isinstance(e, TransferError):
        return e
    text = str(e)
    if "Timed out" in text:
        return TransferError("timeout", f"transfer timed out: {text[:200]}")
    return TransferError("peer", f"transfer channel failed: {text[:200]}")


class StagingPool:
    """Reusable receive buffers, smallest fit first; keeps at most ``max_buffers``."""

    def __init__(self, max_buffers: int = 8) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.max_buffers = max_buffers

    def take(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            # Indices, not list.remove: == on tensors compares elements.
            fits = [
                i for i, b in enumerate(self._free)
                if b.numel() >= n and b.device.type == torch.device(device).type
            ]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                buf = torch.empty(n, dtype=torch.uint8, device=device)
        return buf[:n].view(dtype).view(shape)

    def give(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        with self._lock:
            self._free.append(base.view(-1).view(torch.uint8) if base.dtype != torch.uint8 else base)
            if len(self._free) > self.max_buffers:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view, in host memory (gloo moves CPU tensors)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8)
