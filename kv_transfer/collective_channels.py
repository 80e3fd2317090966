"""The collective backend's pair channels and their framing (``kv_transfer.collective``
builds and uses them).

A channel joins one sender (rank 0) and one receiver (rank 1). A transfer on it is a
fixed-size header (``transfer_header``), which the receiver compares with its own view
first, then its body: K and V, packed, or per layer one message per stretch of blocks
(``BlockPlan``). Both kinds of channel keep the same rules:

- ``Channel``: a two-rank ``torch.distributed.ProcessGroupGloo``, header and body alike
  (CPU tensors). Each transfer has its own tags (allocated by the sender), so a receive
  can only match the send of the same transfer; a refused transfer's body is received
  into scratch memory (``refuse_body``), so its sends end and the channel stays whole.
- ``NcclChannel`` (``kv_transfer.nccl_channel``): the same gloo channel for the header and
  a one-word answer, and a two-rank NCCL communicator for the body, device to device.

What gloo allows sets where a failure ends. Sends are matched by (peer, tag) and wait for
their receive; a posted operation cannot be withdrawn (torch's ``Work`` has no abort); a
wait that times out closes every pair of its group (gloo's own rule); and a message that
arrives for an operation whose buffer was freed stalls the pair's socket for good. So a
failure after an operation was posted and before it matched closes the channel, and
nothing else does. Tags are never reused on a channel: a late message can only match its
own transfer's operation.
"""

from __future__ import annotations

import datetime
import threading
import time
import zlib
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import torch

from kv_transfer.base import TransferError, TransferMeta, contiguous_runs

HEADER_MAGIC = 0x54414E44454D  # "TANDEM"
TAGS_PER_TRANSFER = 4  # packed: header, K, V, and one spare
# torch passes a gloo tag as a C int: a channel whose tags would pass TAG_LIMIT moves to
# a new epoch (``collective.Outgoing``), a fresh channel whose tags start again at 0. The
# top one is no transfer's: ``Channel.close`` waits on it.
TAG_LIMIT = 2**31 - 1
CLOSE_TAG = TAG_LIMIT
# A receiver that refuses a transfer's header receives its messages into scratch memory
# instead (``Channel.refuse_body``), so that the sender's sends end and the channel stays
# whole; past these sizes it closes the channel instead.
MAX_DRAIN_MESSAGES = 1 << 16
MAX_DRAIN_BYTES = 256 << 20
# A paged transfer goes as one message per layer and stretch of consecutive blocks (K
# and V) when that makes at most MAX_MESSAGES, or messages of MIN_MESSAGE_BYTES or more;
# else packed. Measured here: some 50 us a message, against a gather and a scatter at
# about 3 GB/s each, so small messages lose to two copies once they are many.
MAX_MESSAGES = 512
MIN_MESSAGE_BYTES = 64 << 10
BUILD_POLL_S = 0.05  # how often a channel build in progress looks whether the receiver gave it up
CHANNEL_KINDS = ("gloo", "nccl")


class TransferRefused(TransferError):
    """The receiver refused this transfer (took its body into scratch memory, answered no,
    or posted nothing as its deadline had passed): nothing of it is posted here, and the
    channel is whole."""


class PairChannel(Protocol):
    """What the backend asks of a channel, whatever carries its bytes."""

    closed: bool
    on_device: bool  # bodies move device memory where it is (NCCL), not host memory (gloo)

    def send_transfer(self, header: torch.Tensor, body: list[torch.Tensor], tag: int, timeout_s: float) -> bool:
        """Send a header and its body under ``tag`` onwards; False if the receiver refused it."""
        ...

    def receive_header(self, header: torch.Tensor, tag: int, timeout_s: float) -> None:
        """Receive a transfer's header into ``header``."""
        ...

    def receive_body(self, body: list[torch.Tensor], tag: int, timeout_s: float) -> None:
        """Receive the body of the transfer whose header (at ``tag``) this side accepted."""
        ...

    def refuse_body(self, header: torch.Tensor, tag: int, timeout_s: float) -> None:
        """End the transfer whose header (at ``tag``) this side refused, leaving the channel whole."""
        ...

    def close(self) -> None:
        """Fail every pending operation on both sides; the channel is never used again."""
        ...


def transfer_header(
    meta: TransferMeta, nbytes_k: int, nbytes_v: int, blocks: tuple = (), messages: int = 2,
) -> torch.Tensor:
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
        """The direct messages' regions of this side's cache (``side``: "src" or "dst"), as
        flat byte views of it: a receive into one writes the cache."""
        runs = self.src_runs if side == "src" else self.dst_runs
        return [
            flat_bytes(cache[layer, first : first + count])
            for cache in (k_cache, v_cache) for layer in range(cache.shape[0]) for first, count in runs.tolist()
        ]


class Channel:
    """One two-rank gloo group between a sender (rank 0) and a receiver (rank 1); the bytes
    it moves are in host memory."""

    def __init__(self, store, prefix: str, rank: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        # Blocks until the peer builds its side too (or raises at the timeout).
        self._pg = ProcessGroupGloo(PrefixStore(prefix, store), rank, 2, datetime.timedelta(seconds=timeout_s))
        self.peer = 1 - rank
        self.closed = False
        self.on_device = False
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

    def send_transfer(self, header: torch.Tensor, body: list[torch.Tensor], tag: int, timeout_s: float) -> bool:
        """Every message posted at once: a refused body is received into scratch, so it ends."""
        self.exchange("send", [header, *(host_bytes(t) for t in body)], tag, timeout_s)
        return True

    def receive_header(self, header: torch.Tensor, tag: int, timeout_s: float) -> None:
        self.exchange("recv", [header], tag, timeout_s)

    def receive_body(self, body: list[torch.Tensor], tag: int, timeout_s: float) -> None:
        """Into ``body``; a part in device memory is received into host memory, then copied
        (a paged cache on a GPU whose peer shares the device: NCCL cannot join them)."""
        landing = [t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype) for t in body]
        self.exchange("recv", landing, tag + 1, timeout_s)
        for t, host in zip(body, landing):
            if host is not t:
                t.copy_(host)

    def refuse_body(self, header: torch.Tensor, tag: int, timeout_s: float) -> None:
        """Receive a refused transfer's messages into scratch memory: its sends end, and
        nothing stays posted on its tags (gloo cannot withdraw a send, and a send's or
        receive's wait that times out closes the channel). Its messages are at most as
        large as its K or V bytes, the header says. A header of another kind, or one too
        large to drain, raises and the caller closes the channel instead."""
        magic, _, _, nbytes_k, nbytes_v, messages, *_ = header.tolist()
        largest = max(nbytes_k, nbytes_v)
        if magic != HEADER_MAGIC or not 0 < messages <= MAX_DRAIN_MESSAGES or not 0 <= largest <= MAX_DRAIN_BYTES:
            raise TransferError("header", f"a header this side cannot drain: {header.tolist()}")
        scratch = torch.empty(max(largest, 1), dtype=torch.uint8)
        self.exchange("recv", [scratch] * messages, tag + 1, timeout_s)

    def close(self) -> None:
        """Fail the pending operations on both sides: a receive nobody sends to, whose
        wait times out, closes the group's pairs (gloo's rule for a timed-out wait), and
        with them the peer's side. torch's ``abort`` alone leaves them waiting (measured:
        a posted send waited out its whole timeout). Takes some 10 ms.

        Once it returns (on any thread that called it), no receive posted on the channel
        writes another byte: gloo closes the pairs under the locks their reads hold."""
        self.closed = True
        with self._closing:
            pg, self._pg = self._pg, None
            if pg is None:
                return
            try:
                never = pg.recv([torch.zeros(1, dtype=torch.uint8)], self.peer, CLOSE_TAG)
                never.wait(datetime.timedelta(milliseconds=1))
            except Exception:  # the timeout is the point; a pair already closed raises too
                pass
            pg.abort()


def device_identity(device: torch.device) -> str:
    """What tells two caches' devices apart across processes: a GPU's UUID, or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def channel_kind(preferred: str, mine: str, theirs: str) -> str:
    """The kind of a pair's channel: NCCL where the sender prefers it and the two caches are
    on two different GPUs (NCCL takes no two ranks of a communicator on one device), else gloo."""
    return "nccl" if preferred == "nccl" and "cpu" not in (mine, theirs) and mine != theirs else "gloo"


def make_channel(kind: str, store, prefix: str, rank: int, timeout_s: float, device: torch.device) -> PairChannel:
    """This side of a pair's channel of ``kind`` (the sender's), its bodies on ``device``;
    blocks until the peer's side is built too."""
    if kind == "gloo":
        return Channel(store, prefix, rank, timeout_s)
    if kind != "nccl":
        raise TransferError("connect", f"a channel kind this side does not know: {kind!r}")
    from kv_transfer.nccl_channel import NcclChannel

    return NcclChannel(store, prefix, rank, timeout_s, device)


def advertised_host() -> str:
    """The address peers reach this process at: the Ray node's, or loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray worker
        pass
    return "127.0.0.1"


def default_channel() -> str:
    """NCCL where CUDA and cupy's NCCL binding are there, else gloo."""
    if not torch.cuda.is_available():
        return "gloo"
    from engine.model.nccl import load_nccl

    try:
        load_nccl()
    except RuntimeError:
        return "gloo"
    return "nccl"


def close_soon(channels: list) -> None:
    """Close these channels on a thread of their own: the caller is an event loop."""
    if channels:
        threading.Thread(target=lambda: [c.close() for c in channels], name="kv-channel-close", daemon=True).start()


def build_channel(make, peer: str, timeout_s: float, check=lambda: None):
    """``make()``, the build of a channel ``peer`` ("to host:port", for errors), on a thread
    of its own: waited for ``timeout_s`` at most, and ``check()`` every ``BUILD_POLL_S``
    meanwhile (it raises to stop waiting). gloo's build against a peer that left the
    rendezvous can outlast its own timeout five-fold (measured, the connect retried), and
    the caller holds the pair's build lock meanwhile. A build left behind closes its
    channel, should it end built."""
    built: Future = Future()

    def run() -> None:
        try:
            built.set_result(make())
        except Exception as e:
            built.set_exception(e)

    threading.Thread(target=run, name="kv-channel-build", daemon=True).start()
    end = time.monotonic() + timeout_s
    while True:
        try:
            return built.result(timeout=min(BUILD_POLL_S, max(end - time.monotonic(), 0.0)))
        except FutureTimeout:
            pass
        try:
            check()
            if time.monotonic() >= end:
                raise TransferError("connect", f"no channel {peer} within {timeout_s:.1f} s")
        except BaseException:
            built.add_done_callback(_close_if_built)
            raise


def _close_if_built(built: Future) -> None:
    if not built.cancelled() and built.exception() is None:
        built.result().close()


DEVICE_KEY = "device"  # in a receiver's store: its cache's ``device_identity``


def kind_key(prefix: str) -> str:
    """The store key under which a channel's sender names the channel's kind."""
    return f"{prefix}/kind"


def given_up_key(sender: str, epoch: int) -> str:
    """The receiver's store key saying it gave up building this sender's epoch."""
    return f"given-up/{sender}/{epoch}"


def store_client(host: str, port: int, timeout_s: float):
    """A client of a rendezvous store whose waits end at ``timeout_s``: one per channel
    build, as each has its own deadline."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def as_transfer_error(e: Exception) -> TransferError:
    """A channel's failure as the transfer's error: timed out, or the peer gone."""
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


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view where it lives (a view when contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8)


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view, in host memory (gloo moves CPU tensors)."""
    return flat_bytes(t if t.device.type == "cpu" else t.cpu())
