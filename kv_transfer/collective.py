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

A transfer that fails for its own reasons fails alone, and the pair's other transfers
go on over the same channel: its deadline passed before it sent (the push posts nothing),
the receiver refused its header (the receiver drains its messages into scratch memory, so
the sends end and no byte reaches the blocks), or the receiver gave it up before its push
posted (``abandon``; the push then posts nothing). A channel that fails (peer gone, a
gloo error, a send or receive whose wait timed out, a push abandoned after it posted) is
closed on the side that saw it, which makes the peer's pending operations on it fail
too; the sender then moves to the next epoch, and the receiver refuses payloads of an
epoch it has closed. The next transfer builds a fresh channel; nothing else is touched.

What gloo allows sets that line. Sends are matched by (peer, tag) and wait for their
receive; a posted operation cannot be withdrawn (torch's ``Work`` has no abort); a wait
that times out closes every pair of its group (gloo's own rule); and a message that
arrives for an operation whose buffer was freed stalls the pair's socket for good. So a
failure after an operation was posted and before it matched closes the channel, and
nothing else does. Tags are never reused on a channel: a late message can only match
its own transfer's operation.

Channel lifecycle (sender view)::

    first push to endpoint ─▶ build(epoch) ─▶ open ─▶ send, send, ... ─▶ a channel failure
       ─▶ close, epoch += 1 ─▶ next push builds(epoch) ...
    open ─▶ tags would pass TAG_LIMIT ─▶ epoch += 1 (tags from 0); the old channel stays
       open for the transfers prepared on it and closes when the last is released

Each payload names the sender's live epochs (``live``); the receiver closes that
sender's older channels not among them. Deadlines: ``TransferMeta.deadline`` is wall-clock
(``time.time()``) and the two sides compare it on their own clocks, so skew between
hosts moves one side's give-up against the other's; the waits themselves (builds,
sends, receives, and a transfer's wait for a build another transfer started) are
relative timeouts on the monotonic clock, taken from the time left. A build runs on a
thread of its own and is waited for no longer (``_build``): gloo's can outlast its own
timeout five-fold when the peer left the rendezvous, and the pair's transfers wait. The
sender's also stops at the receiver's mark that it gave the epoch up, which may land
after the build began. A receive whose channel came only past its deadline posts
nothing and leaves the channel whole.

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
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager

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
# torch passes a gloo tag as a C int: a channel whose tags would pass TAG_LIMIT moves to
# a new epoch (``_Outgoing``), a fresh channel whose tags start again at 0. The top one is
# no transfer's: ``Channel.close`` waits on it.
TAG_LIMIT = 2**31 - 1
CLOSE_TAG = TAG_LIMIT
# A receiver that refuses a transfer's header receives its messages into scratch memory
# instead (``_drain``), so that the sender's sends end and the channel stays whole; past
# these sizes it closes the channel instead.
MAX_DRAIN_MESSAGES = 1 << 16
REFUSE_MARGIN_S = 1.0  # a refused transfer is drained only with this much of its deadline left
MAX_DRAIN_BYTES = 256 << 20
# A paged transfer goes as one message per layer and stretch of consecutive blocks (K
# and V) when that makes at most MAX_MESSAGES, or messages of MIN_MESSAGE_BYTES or more;
# else packed. Measured here: some 50 us a message, against a gather and a scatter at
# about 3 GB/s each, so small messages lose to two copies once they are many.
MAX_MESSAGES = 512
MIN_MESSAGE_BYTES = 64 << 10
BUILD_POLL_S = 0.05  # how often a channel build in progress looks whether the receiver gave it up


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


class _Outgoing:
    """The sender's state towards one receiver endpoint: its live epochs (each with its
    channel once built), the next tag of the current one, and its transfers by state.

    Epoch lifecycle::

        current ─▶ (tags would pass TAG_LIMIT) rotated: its transfers finish, no new ones
                       ─▶ its last transfer released ─▶ closed
        current or rotated ─▶ (a push failed on it, or was abandoned mid-send) dropped,
                       closed at once; a new current epoch if it was the current one

    Every transfer takes its tags from its epoch's own count, so a tag is never reused on
    a channel: gloo matches a message by (peer, tag), and a receive posted for an older
    transfer would take a newer one's bytes. ``state`` guards all of it and is never held
    while a channel builds or closes (``building`` serializes builds), so ``take``,
    ``abandon`` and ``drop``, which run on event loops, never wait for a build.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.next_tag = 0
        self.live: dict[int, Channel | None] = {0: None}
        self.outstanding: Counter = Counter()  # epoch -> transfers prepared, not released
        self.posted: set[tuple[int, int]] = set()  # (epoch, first tag) of pushes whose sends are posted
        self.abandoned: set[tuple[int, int]] = set()  # abandoned before their push posted
        self.building = threading.Lock()
        self.state = threading.Lock()

    def take(self, count: int) -> tuple[dict, list[Channel]]:
        """Epoch and tags for one transfer (a payload's part), and channels to close."""
        if count > TAG_LIMIT:
            raise TransferError("layout", f"a transfer of {count} messages passes the {TAG_LIMIT} tags of a channel")
        closing = []
        with self.state:
            if self.next_tag + count > TAG_LIMIT:
                # Rather than wrap: a receive of an older transfer may still be posted
                # (or be posted later) on any tag of this channel.
                old, self.epoch, self.next_tag = self.epoch, self.epoch + 1, 0
                self.live[self.epoch] = None
                closing = self._retire_if_done(old)
            first, self.next_tag = self.next_tag, self.next_tag + count
            self.outstanding[self.epoch] += 1
            part = {"epoch": self.epoch, "tag": first, "live": tuple(sorted(self.live))}
        return part, closing

    def release(self, epoch: int, tag: int) -> list[Channel]:
        with self.state:
            self.abandoned.discard((epoch, tag))
            if self.outstanding[epoch] > 0:
                self.outstanding[epoch] -= 1
            return self._retire_if_done(epoch)

    def _retire_if_done(self, epoch: int) -> list[Channel]:
        if epoch == self.epoch or self.outstanding[epoch] > 0 or epoch not in self.live:
            return []
        del self.outstanding[epoch]
        channel = self.live.pop(epoch)
        return [channel] if channel is not None else []

    def drop(self, epoch: int) -> list[Channel]:
        """The epoch's channel failed or cannot be trusted: closed, never used again."""
        with self.state:
            channel = self.live.pop(epoch, None)
            self.outstanding.pop(epoch, None)
            if epoch == self.epoch:
                self.epoch, self.next_tag = self.epoch + 1, 0
                self.live[self.epoch] = None
        return [channel] if channel is not None else []


class CollectiveBackend(KVTransferBackend):
    """One worker's gloo transport (the module docstring has a channel's lifecycle): the rendezvous
    store senders reach and a channel per peer, each built on first use; paged on CPUs, packed
    through host memory on GPUs. Made by ``TransferConfig.make_backend``."""

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
            outgoing = list(self._out.values())
        built = 0
        for out in outgoing:
            with out.state:
                built += sum(c is not None for c in out.live.values())
        with self._lock:
            return built + len(self._in)

    # -- sender ---------------------------------------------------------------------

    def prepare(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor) -> dict:
        if not meta.dst_endpoint:
            raise TransferError("no_endpoint", "the receiver published no transfer endpoint")
        expected = meta.layout.nbytes(meta.num_blocks)
        if k.nbytes + v.nbytes != expected:
            raise TransferError("layout", f"KV holds {k.nbytes + v.nbytes} bytes, its layout says {expected}")
        return self._offer(meta, TAGS_PER_TRANSFER)

    def _offer(self, meta: TransferMeta, count: int) -> dict:
        """The payload's channel part: sender, epoch, first of ``count`` tags, and the
        epochs of this sender still live (its older ones the receiver may close)."""
        part, closing = self._outgoing(meta.dst_endpoint).take(count)
        _close_soon(closing)  # an epoch rotated out with nothing in flight; on the event loop here
        return {"sender": self.sender_id, **part}

    def _outgoing(self, endpoint: str) -> _Outgoing:
        with self._lock:
            return self._out.setdefault(endpoint, _Outgoing())

    def push(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor, payload: dict) -> None:
        """Send the transfer's messages. A failure before they are posted (deadline passed,
        abandoned, the epoch gone) is the transfer's alone; once posted, a send cannot be
        withdrawn (gloo has no cancel, and one that outlives its buffer stalls the pair),
        so a failure then closes the channel."""
        t0 = time.perf_counter()
        out = self._outgoing(meta.dst_endpoint)
        epoch, key = payload["epoch"], (payload["epoch"], payload["tag"])
        channel = self._send_channel(meta.dst_endpoint, out, meta, epoch)
        if "blocks" in payload:  # paged: out of this worker's blocks
            messages, nbytes = self._push_blocks(meta, payload)
        else:
            messages = [transfer_header(meta, k.nbytes, v.nbytes), _host_bytes(k), _host_bytes(v)]
            nbytes = k.nbytes + v.nbytes
        timeout_s = self._op_timeout(meta)
        with out.state:
            if key in out.abandoned:
                raise TransferError("abandoned", f"transfer {meta.transfer_id}: the receiver gave it up")
            if timeout_s <= 0:
                raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")
            out.posted.add(key)
        try:
            channel.exchange("send", messages, payload["tag"], timeout_s)
        except Exception as e:
            self._drop_outgoing(out, epoch)
            raise _as_transfer_error(e) from e
        finally:
            with out.state:
                out.posted.discard(key)
        self.stats.sent += 1
        self.stats.bytes_sent += nbytes
        self.stats.seconds_sending += time.perf_counter() - t0

    def _send_channel(self, endpoint: str, out: _Outgoing, meta: TransferMeta, epoch: int) -> Channel:
        """The channel to ``endpoint`` on ``epoch``, built if need be within the transfer's
        time (a receiver that gave up or died fails it by then, not 30 s later)."""
        with out.state:
            if out.live.get(epoch) is not None:
                return out.live[epoch]
        with self._within(out.building, meta):
            with out.state:
                if epoch not in out.live:
                    raise TransferError("channel_closed", "the channel this transfer was prepared on closed")
                channel = out.live[epoch]
            if channel is not None:
                return channel
            timeout_s = self._connect_timeout(meta)
            if timeout_s <= 0:
                # Its own failure: others may be waiting for this build. Should the
                # receiver have given it up, the next build finds that in the store, and
                # drops the epoch then.
                raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")
            host, port = endpoint.rsplit(":", 1)
            try:
                store, watch = _client(host, int(port), timeout_s), _client(host, int(port), timeout_s)
                mark = _given_up(self.sender_id, epoch)

                def check() -> None:  # before the build, and while it runs: the receiver may give up any time
                    if watch.check([mark]):
                        raise TransferError("channel_closed", f"epoch {epoch}'s channel is closed: "
                                                              "the receiver gave up building it")

                check()
                channel = _build(lambda: Channel(store, f"{self.sender_id}/{epoch}", 0, timeout_s), f"to {endpoint}",
                                 timeout_s, check)
            except Exception as e:
                self._drop_outgoing(out, epoch)  # a half-built rendezvous must not be joined again
                if isinstance(e, TransferError):
                    raise
                raise TransferError("connect", f"no channel to {endpoint}: {e}") from e
            with out.state:
                if epoch in out.live:
                    out.live[epoch] = channel
                    return channel
        channel.close()  # dropped while it was built
        raise TransferError("channel_closed", "the channel this transfer was prepared on closed")

    def _drop_outgoing(self, out: _Outgoing, epoch: int) -> None:
        for channel in out.drop(epoch):
            channel.close()

    def abandon(self, meta: TransferMeta, payload: dict) -> None:
        """The receiver gave up on this transfer: its push must not wait for a receive that
        never comes. Runs on the event loop, so it waits for nothing: neither a channel
        build nor a close. A push not yet posted then fails alone when it comes to post;
        one whose sends are posted can only be stopped by closing the channel (gloo cannot
        withdraw a send, and a send's wait that times out closes the channel anyway),
        which a thread of its own does; one that ended is left be."""
        out = self._outgoing(meta.dst_endpoint)
        key = (payload["epoch"], payload["tag"])
        with out.state:
            posted = key in out.posted
            if not posted:
                out.abandoned.add(key)  # until ``release``
        if posted:
            _close_soon(out.drop(payload["epoch"]))

    def release(self, meta: TransferMeta, payload: dict) -> None:
        """The transfer is over for the sender: a rotated epoch closes with its last one."""
        if isinstance(payload, dict) and "epoch" in payload:
            _close_soon(self._outgoing(meta.dst_endpoint).release(payload["epoch"], payload["tag"]))

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
        return {**self._offer(meta, 1 + plan.num_messages), "blocks": tuple(block_ids)}

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
        channel = self._recv_channel(key, meta, payload.get("live", (key[1],)))
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
        """The header first; the body's receives are posted only once it matches. Raises
        ``TransferRefused`` when the header differs and the channel is left whole, or when
        the deadline passed before anything was posted (a channel whose build ended late:
        a receive posted now would have to close the channel, failing the pair's others)."""
        timeout_s = self._op_timeout(meta)
        if timeout_s <= 0:
            raise TransferRefused("timeout", f"transfer {meta.transfer_id} passed its deadline")
        header = torch.zeros_like(expected)
        channel.exchange("recv", [header], tag, timeout_s)
        if not torch.equal(header, expected):
            self._drain(channel, header, tag)
            raise TransferRefused(
                "header", f"transfer {meta.transfer_id}: header mismatch, the sender announced {header.tolist()}, "
                f"expected {expected.tolist()} (id hash, blocks, K bytes, V bytes, messages)",
            )
        channel.exchange("recv", body, tag + 1, self._op_timeout(meta))

    def _drain(self, channel: Channel, header: torch.Tensor, tag: int) -> None:
        """Receive a refused transfer's messages into scratch memory: its sends end, and
        nothing stays posted on its tags (gloo cannot withdraw a send, and a send's or
        receive's wait that times out closes the channel). Its messages are at most as
        large as its K or V bytes, the header says. A header of another kind, or one
        too large to drain, raises and the caller closes the channel instead."""
        magic, _, _, nbytes_k, nbytes_v, messages, *_ = header.tolist()
        largest = max(nbytes_k, nbytes_v)
        if magic != HEADER_MAGIC or not 0 < messages <= MAX_DRAIN_MESSAGES or not 0 <= largest <= MAX_DRAIN_BYTES:
            raise TransferError("header", f"a header this side cannot drain: {header.tolist()}")
        scratch = torch.empty(max(largest, 1), dtype=torch.uint8)
        # Its own time, not the transfer's: the sender posted every message with the header.
        channel.exchange("recv", [scratch] * messages, tag + 1, self.op_timeout_s)

    def refuse(self, meta: TransferMeta, payload: dict) -> None:
        """Receive a transfer this side will not use into scratch memory (its header,
        then what it announces), so that its push ends and the pair's other transfers go
        on. Only while its deadline is ahead: past it the sender posts nothing, and a
        receive that nobody matches would close the channel when it timed out."""
        if not isinstance(payload, dict) or "tag" not in payload or meta.time_left() < REFUSE_MARGIN_S:
            return
        key = (payload["sender"], payload["epoch"])
        try:
            channel = self._recv_channel(key, meta, payload.get("live", (key[1],)))
            header = torch.zeros_like(transfer_header(meta, 0, 0))
            channel.exchange("recv", [header], payload["tag"], self._op_timeout(meta))
            self._drain(channel, header, payload["tag"])
        except Exception:  # the channel was closed on the way: the push has failed already
            self._drop_incoming(key)

    def pull(self, meta: TransferMeta, payload: dict) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        self.check_deadline(meta)
        key = (payload["sender"], payload["epoch"])
        channel = self._recv_channel(key, meta, payload.get("live", (key[1],)))
        dtype = getattr(torch, meta.layout.dtype)
        shape = meta.layout.packed_shape(meta.num_blocks)
        k = self._staging.take(shape, dtype, "cpu")
        v = self._staging.take(shape, dtype, "cpu")
        expected = transfer_header(meta, k.nbytes, v.nbytes)
        try:
            self._receive_checked(channel, meta, payload["tag"], expected, [_host_bytes(k), _host_bytes(v)])
        except TransferRefused:
            self.recycle(k, v)  # never posted
            raise
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

    def _recv_channel(self, key: tuple[str, int], meta: TransferMeta, live: tuple[int, ...]) -> Channel:
        """The channel from this sender and epoch, built if need be within the transfer's
        time: a sender that died before building its side fails the transfer by its
        deadline, and every transfer waiting on the same build fails with it.
        ``live``: the sender's epochs still in use; it gave up the older ones not among them."""
        sender, epoch = key
        store = self._store_or_fail()
        with self._lock:
            if key in self._closed_in:
                raise TransferError("channel_closed", "the channel this transfer was prepared on closed")
            given_up = [k for k in self._in if k[0] == sender and k[1] < epoch and k[1] not in live]
            self._closed_in.update(given_up)
            given_up = [self._in.pop(k) for k in given_up]
            building = self._in_building.setdefault(key, threading.Lock())
        for channel in given_up:
            channel.close()
        with self._within(building, meta):
            with self._lock:
                if key in self._in:
                    return self._in[key]
                if key in self._closed_in:  # its build failed while this transfer waited
                    raise TransferError("channel_closed", f"no channel from {sender}: its build failed")
            timeout_s = self._connect_timeout(meta)
            try:
                if timeout_s <= 0:
                    raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")
                client = _client("127.0.0.1", store.port, timeout_s)
                prefix = f"{sender}/{epoch}"
                channel = _build(lambda: Channel(client, prefix, 1, timeout_s), f"from {sender}", timeout_s)
            except Exception as e:
                with self._lock:
                    self._closed_in.add(key)
                    self._in_building.pop(key, None)
                try:  # the sender's next build on this epoch then fails at once, and moves on
                    store.set(_given_up(sender, epoch), "1")
                except Exception:  # this process's own store; without the mark, that build fails by its deadline
                    pass
                if isinstance(e, TransferError):
                    raise
                raise TransferError("connect", f"no channel from {sender}: {e}") from e
            with self._lock:
                self._in[key] = channel
                self._in_building.pop(key, None)
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
            outgoing = list(self._out.values())
            channels = list(self._in.values())
            self._out.clear()
            self._in.clear()
        for out in outgoing:
            with out.state:
                channels += [c for c in out.live.values() if c is not None]
                out.live.clear()
        for c in channels:
            c.close()

    def _connect_timeout(self, meta: TransferMeta) -> float:
        return min(self.connect_timeout_s, meta.time_left()) if meta.deadline else self.connect_timeout_s

    def _op_timeout(self, meta: TransferMeta) -> float:
        return min(self.op_timeout_s, meta.time_left()) if meta.deadline else self.op_timeout_s


class TransferRefused(TransferError):
    """The receiver refused this transfer (drained its messages, or posted nothing as its
    deadline had passed): nothing of it is posted here, and the channel is whole."""


def _close_soon(channels: list[Channel]) -> None:
    """Close these channels on a thread of their own: the caller is an event loop."""
    if channels:
        threading.Thread(target=lambda: [c.close() for c in channels], name="kv-channel-close", daemon=True).start()


def _build(make, peer: str, timeout_s: float, check=lambda: None) -> Channel:
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


def _given_up(sender: str, epoch: int) -> str:
    """The receiver's store key saying it gave up building this sender's epoch."""
    return f"given-up/{sender}/{epoch}"


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
