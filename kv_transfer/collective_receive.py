"""The receiving half of the collective backend (``kv_transfer.collective``, whose
docstring has the rules both halves keep): the rendezvous store senders reach, the
channels from each sender by epoch (``collective_epochs.Incoming``), and the receives
into this worker's reserved blocks (paged) or into staging buffers (packed).
"""

from __future__ import annotations

import datetime
import threading
import time
from contextlib import contextmanager

import torch

from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta, check_attachable
from kv_transfer.collective_channels import (
    CHANNEL_KINDS,
    DEVICE_KEY,
    BlockPlan,
    PairChannel,
    StagingPool,
    TransferRefused,
    advertised_host,
    as_transfer_error,
    build_channel,
    default_channel,
    device_identity,
    flat_bytes,
    given_up_key,
    kind_key,
    make_channel,
    store_client,
    transfer_header,
)
from kv_transfer.collective_epochs import Incoming

REFUSE_MARGIN_S = 1.0  # a refused transfer is drained only with this much of its deadline left


def _cache_device(device: torch.device | str | None, on_gpu: bool) -> torch.device:
    """Where the cache lives: ``device``, or the current CUDA device on GPUs, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


class CollectiveReceiver(KVTransferBackend):
    """The receiving half of ``CollectiveBackend``: the state both halves share, and the
    receives. ``channel`` forces a kind (``CHANNEL_KINDS``); ``device`` is the cache's."""

    def __init__(self, op_timeout_s: float = 60.0, connect_timeout_s: float = 30.0,
                 channel: str | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.channel = channel or default_channel()
        if self.channel not in CHANNEL_KINDS:
            raise ValueError(f"a collective channel is one of {CHANNEL_KINDS}, got {channel!r}")
        self.on_gpu = torch.cuda.is_available()
        self.device = _cache_device(device, self.on_gpu)
        # NCCL moves the cache's device memory itself; gloo moves host memory, so on GPUs
        # its bytes go packed through host staging buffers.
        self.paged = self.device.type == "cpu" or self.channel == "nccl"
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._in = Incoming()  # (sender id, epoch) -> channel
        self._store = None
        self._endpoint = ""
        self._staging = StagingPool()

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
                self._store.set(DEVICE_KEY, device_identity(self.device))  # a sender chooses its channel by it
                self._endpoint = f"{advertised_host()}:{self._store.port}"
            return self._endpoint

    def attach_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        check_attachable(self._cache, k, v)
        self._cache = (k, v)

    def _attached(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None:
            raise RuntimeError("no paged cache attached (attach_cache)")
        return self._cache

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
            body = [flat_bytes(self._staging.take(shape, k_cache.dtype, k_cache.device)) for _ in range(2)]
        key = (payload["sender"], payload["epoch"])
        channel = self._recv_channel(key, meta, payload)
        try:
            self._receive_checked(channel, meta, payload["tag"], expected, body)
        except TransferRefused:
            if not plan.direct:
                for staged in body:
                    self._staging.give(staged)
            raise
        except Exception as e:
            # Closed, the channel writes nothing more into the blocks (or staging buffers).
            self._drop_incoming(key)
            channel.close()
            raise as_transfer_error(e) from e
        if not plan.direct:
            index = torch.tensor(block_ids)
            for cache, staged in zip((k_cache, v_cache), body):
                cache[:, index] = staged.view(k_cache.dtype).view(shape)
                self._staging.give(staged)
        self.stats.received += 1
        self.stats.bytes_received += sum(t.nbytes for t in body)
        self.stats.seconds_receiving += time.perf_counter() - t0

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

    def _receive_checked(self, channel: PairChannel, meta: TransferMeta, tag: int, expected: torch.Tensor,
                         body: list[torch.Tensor]) -> None:
        """The header first; the body is received only once it matches. Raises
        ``TransferRefused`` when the header differs and the channel is left whole, or when
        the deadline passed before anything was posted (a channel whose build ended late:
        a receive posted now would have to close the channel, failing the pair's others)."""
        timeout_s = self._op_timeout(meta)
        if timeout_s <= 0:
            raise TransferRefused("timeout", f"transfer {meta.transfer_id} passed its deadline")
        header = torch.zeros_like(expected)
        channel.receive_header(header, tag, timeout_s)
        if not torch.equal(header, expected):
            # Its own time, not the transfer's: the sender posted its body with the header.
            channel.refuse_body(header, tag, self.op_timeout_s)
            raise TransferRefused(
                "header", f"transfer {meta.transfer_id}: header mismatch, the sender announced {header.tolist()}, "
                f"expected {expected.tolist()} (id hash, blocks, K bytes, V bytes, messages)",
            )
        channel.receive_body(body, tag, self._op_timeout(meta))

    def refuse(self, meta: TransferMeta, payload: dict) -> None:
        """Take a transfer this side will not use off the channel (its header, then its
        body into scratch memory, or a no), so that its push ends and the pair's other
        transfers go on. Only while its deadline is ahead: past it the sender posts
        nothing, and a receive that nobody matches would close the channel when it timed out."""
        if not isinstance(payload, dict) or "tag" not in payload or meta.time_left() < REFUSE_MARGIN_S:
            return
        key = (payload["sender"], payload["epoch"])
        try:
            channel = self._recv_channel(key, meta, payload)
            header = torch.zeros_like(transfer_header(meta, 0, 0))
            channel.receive_header(header, payload["tag"], self._op_timeout(meta))
            channel.refuse_body(header, payload["tag"], self.op_timeout_s)
        except Exception:  # the channel was closed on the way: the push has failed already
            self._drop_incoming(key)

    def pull(self, meta: TransferMeta, payload: dict) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        self.check_deadline(meta)
        key = (payload["sender"], payload["epoch"])
        channel = self._recv_channel(key, meta, payload)
        dtype = getattr(torch, meta.layout.dtype)
        shape = meta.layout.packed_shape(meta.num_blocks)
        device = self.device if channel.on_device else torch.device("cpu")
        k = self._staging.take(shape, dtype, device)
        v = self._staging.take(shape, dtype, device)
        expected = transfer_header(meta, k.nbytes, v.nbytes)
        try:
            self._receive_checked(channel, meta, payload["tag"], expected, [flat_bytes(k), flat_bytes(v)])
        except TransferRefused:
            self.recycle(k, v)  # never posted
            raise
        except Exception as e:
            # A receive that gave up may still be posted: the buffers stay out of the pool.
            self._drop_incoming(key)
            raise as_transfer_error(e) from e
        self.stats.received += 1
        self.stats.bytes_received += k.nbytes + v.nbytes
        self.stats.seconds_receiving += time.perf_counter() - t0
        if self.on_gpu and k.device.type == "cpu":
            k, v = k.cuda(non_blocking=True), v.cuda(non_blocking=True)
        return k, v

    def _recv_channel(self, key: tuple[str, int], meta: TransferMeta, payload: dict) -> PairChannel:
        """The channel from this sender and epoch, of the kind it chose, built if
        need be within the transfer's time: a sender that died before building its side
        fails the transfer by its deadline, and every transfer waiting on the same build
        fails with it. The payload's ``live``: the sender's epochs still in use; it gave up
        the older ones not among them."""
        sender, epoch = key
        store = self._store_or_fail()
        building, given_up = self._in.enter(key, tuple(payload.get("live", (epoch,))))
        for channel in given_up:
            channel.close()
        with self._within(building, meta):
            built = self._in.built(key)
            if built is not None:
                return built
            timeout_s = self._connect_timeout(meta)
            try:
                if timeout_s <= 0:
                    raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")
                client = store_client("127.0.0.1", store.port, timeout_s)
                prefix = f"{sender}/{epoch}"

                def make() -> PairChannel:  # the sender says which kind once it begins its build
                    client.wait([kind_key(prefix)])
                    kind = client.get(kind_key(prefix)).decode()
                    return make_channel(kind, client, prefix, 1, timeout_s, self.device)

                channel = build_channel(make, f"from {sender}", timeout_s)
            except Exception as e:
                self._in.failed(key)
                try:  # the sender's next build on this epoch then fails at once, and moves on
                    store.set(given_up_key(sender, epoch), "1")
                except Exception:  # this process's own store; without the mark, that build fails by its deadline
                    pass
                if isinstance(e, TransferError):
                    raise
                raise TransferError("connect", f"no channel from {sender}: {e}") from e
            self._in.add(key, channel)
            return channel

    @contextmanager
    def _within(self, lock: threading.Lock, meta: TransferMeta):
        """Hold a build lock, which another transfer's build may hold for that one's time,
        waiting no longer than this transfer's own."""
        if not lock.acquire(timeout=max(self._connect_timeout(meta), 0.0)):
            raise TransferError("timeout",
                                f"transfer {meta.transfer_id} passed its deadline waiting for a channel build")
        try:
            yield
        finally:
            lock.release()

    def _store_or_fail(self):
        if self._store is None:
            raise TransferError("no_endpoint", "this process published no transfer endpoint")
        return self._store

    def _drop_incoming(self, key: tuple[str, int]) -> None:
        channel = self._in.drop(key)
        if channel is not None:
            channel.close()

    def recycle(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.device.type == "cpu" or self.channel == "nccl":
            self._staging.give(k)
            self._staging.give(v)

    def _connect_timeout(self, meta: TransferMeta) -> float:
        return min(self.connect_timeout_s, meta.time_left()) if meta.deadline else self.connect_timeout_s

    def _op_timeout(self, meta: TransferMeta) -> float:
        return min(self.op_timeout_s, meta.time_left()) if meta.deadline else self.op_timeout_s
