"""Collective backend: a two-rank channel per sender-receiver pair, made on first use.

Every receiving process hosts a small rendezvous store (``endpoint``, "host:port",
published in its reservations). A sender that first pushes to an endpoint and the
receiver that first pulls from that sender both build the pair's channel
(``kv_transfer.collective_channels``: a two-rank gloo group, sender 0 and receiver 1, and
on GPUs a two-rank NCCL communicator beside it for the bytes) keyed by the sender's id and
an epoch (``kv_transfer.collective_epochs``); no process joins any group wider than a
pair, so a worker joining, leaving or dying touches only its own channels and transfers
between other pairs never pause.

Each transfer has its own message tags on its channel (allocated by the sender, sent in
the payload), so a receive can only match the send of the same transfer: transfers of
one pair may run in any order and concurrently, and one that gives up cannot shift
another's bytes. A transfer is a fixed-size header (transfer id, block count, layout,
byte counts), then its body. The receiver takes the header first and receives the body
only when it matches what it expects, so no byte lands for a transfer that is not the
one announced, and a receive never meets a larger message (gloo aborts the process on
that).

A transfer that fails for its own reasons fails alone, and the pair's other transfers
go on over the same channel: its deadline passed before it sent (the push posts nothing),
the receiver refused its header (its body is drained into scratch memory, or on NCCL
never sent), or the receiver gave it up before its push posted (``abandon``; the push
then posts nothing). A channel that fails (peer gone, a gloo or NCCL error, a send or
receive whose wait timed out, a push abandoned after it posted) is closed on the side
that saw it, which makes the peer's pending operations on it fail too; the sender then
moves to the next epoch, and the receiver refuses payloads of an epoch it has closed.
The next transfer builds a fresh channel; nothing else is touched.

Deadlines: ``TransferMeta.deadline`` is wall-clock (``time.time()``) and the two sides
compare it on their own clocks, so skew between hosts moves one side's give-up against
the other's; the waits themselves (builds, sends, receives, and a transfer's wait for a
build another transfer started) are relative timeouts on the monotonic clock, taken from
the time left. A build runs on a thread of its own and is waited for no longer
(``build_channel``): gloo's can outlast its own timeout five-fold when the peer left the
rendezvous, and the pair's transfers wait. The sender's also stops at the receiver's
mark that it gave the epoch up, which may land after the build began. A receive whose
channel came only past its deadline posts nothing and leaves the channel whole.

The backend is paged wherever its channel reaches the cache's memory (gloo on CPUs, NCCL
on GPUs): each worker attaches its paged cache, and a transfer goes from the sender's
blocks straight into the receiver's reserved ones, with neither a gather on one side nor
a scatter on the other. The cache is ``[layers, blocks, ...]``, so one layer's stretch of
blocks that are consecutive on both sides is one contiguous region at each end, and one
message: a transfer is the header, then per layer one message per such stretch of K,
then the same for V. Both sides derive that split from the same two block lists (the
sender's in the payload, the receiver's in ``TransferMeta.dst_blocks``), and the header
carries a hash of both, so a receive never meets a message of another size. Blocks so
scattered that the split would pass ``MAX_MESSAGES`` go packed instead (gathered, sent
as one K and one V, scattered).

The channel's kind: a backend prefers NCCL where CUDA and cupy's NCCL are there, else
gloo (``channel`` forces one). A receiver's store says which device its cache is on, and a
sender builds NCCL only to a cache on another GPU (NCCL takes no two ranks of one
communicator on one device), gloo otherwise; it writes the kind in the store, where the
receiver's build reads it. Over gloo a GPU's bytes are staged through host memory: a
backend without NCCL moves packed KV, whose K and V arrive in staging buffers that are
kept and reused (``recycle``: fresh ones cost a page fault per 4 KiB, which measured
slower than the transfer itself); a paged one whose peer shares its GPU stages each
message.
"""

from __future__ import annotations

import time
import uuid

import torch

from kv_transfer.base import TransferError, TransferMeta
from kv_transfer.collective_channels import (
    DEVICE_KEY,
    TAGS_PER_TRANSFER,
    BlockPlan,
    PairChannel,
    as_transfer_error,
    build_channel,
    channel_kind,
    close_soon,
    device_identity,
    flat_bytes,
    given_up_key,
    kind_key,
    make_channel,
    store_client,
    transfer_header,
)
from kv_transfer.collective_epochs import Outgoing
from kv_transfer.collective_receive import CollectiveReceiver


class CollectiveBackend(CollectiveReceiver):
    """One worker's collective transport (the module docstring has the rules): the rendezvous
    store senders reach and a channel per peer, each built on first use; paged where the
    channel reaches the cache (gloo on CPUs, NCCL on GPUs), else packed through host memory.
    Made by ``TransferConfig.make_backend``; ``channel`` forces a kind (``CHANNEL_KINDS``).
    The receiving half is ``CollectiveReceiver``; this class adds the sending one."""

    name = "collective"
    sends = True

    def __init__(self, op_timeout_s: float = 60.0, connect_timeout_s: float = 30.0,
                 channel: str | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(op_timeout_s, connect_timeout_s, channel, device)
        self.sender_id = uuid.uuid4().hex[:12]
        self._out: dict[str, Outgoing] = {}  # receiver endpoint -> state

    @property
    def num_channels(self) -> int:
        with self._lock:
            outgoing = list(self._out.values())
        built = 0
        for out in outgoing:
            with out.state:
                built += sum(c is not None for c in out.live.values())
        with self._in.lock:
            return built + len(self._in.channels)
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
        close_soon(closing)  # an epoch rotated out with nothing in flight; on the event loop here
        return {"sender": self.sender_id, **part}

    def _outgoing(self, endpoint: str) -> Outgoing:
        with self._lock:
            return self._out.setdefault(endpoint, Outgoing())

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
            header, body = self._push_blocks(meta, payload)
        else:
            header, body = transfer_header(meta, k.nbytes, v.nbytes), [flat_bytes(k), flat_bytes(v)]
        timeout_s = self._op_timeout(meta)
        with out.state:
            if key in out.abandoned:
                raise TransferError("abandoned", f"transfer {meta.transfer_id}: the receiver gave it up")
            if timeout_s <= 0:
                raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline")
            out.posted.add(key)
        try:
            delivered = channel.send_transfer(header, body, payload["tag"], timeout_s)
        except Exception as e:
            self._drop_outgoing(out, epoch)
            raise as_transfer_error(e) from e
        finally:
            with out.state:
                out.posted.discard(key)
        if not delivered:
            return  # the receiver said no: its pull has failed already
        self.stats.sent += 1
        self.stats.bytes_sent += sum(t.nbytes for t in body)
        self.stats.seconds_sending += time.perf_counter() - t0

    def _send_channel(self, endpoint: str, out: Outgoing, meta: TransferMeta, epoch: int) -> PairChannel:
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
                store, watch = store_client(host, int(port), timeout_s), store_client(host, int(port), timeout_s)
                mark = given_up_key(self.sender_id, epoch)

                def check() -> None:  # before the build, and while it runs: the receiver may give up any time
                    if watch.check([mark]):
                        raise TransferError("channel_closed", f"epoch {epoch}'s channel is closed: "
                                                              "the receiver gave up building it")

                check()
                prefix = f"{self.sender_id}/{epoch}"
                kind = channel_kind(self.channel, device_identity(self.device), store.get(DEVICE_KEY).decode())
                store.set(kind_key(prefix), kind)
                channel = build_channel(lambda: make_channel(kind, store, prefix, 0, timeout_s, self.device),
                                        f"to {endpoint}", timeout_s, check)
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

    def _drop_outgoing(self, out: Outgoing, epoch: int) -> None:
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
            close_soon(out.drop(payload["epoch"]))

    def release(self, meta: TransferMeta, payload: dict) -> None:
        """The transfer is over for the sender: a rotated epoch closes with its last one."""
        if isinstance(payload, dict) and "epoch" in payload:
            close_soon(self._outgoing(meta.dst_endpoint).release(payload["epoch"], payload["tag"]))

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

    def _push_blocks(self, meta: TransferMeta, payload: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The header and body of a paged transfer, its body out of this worker's blocks."""
        k_cache, v_cache = self._attached()
        plan = BlockPlan(list(payload["blocks"]), list(meta.dst_blocks), k_cache)
        if plan.direct:
            body = plan.regions(k_cache, v_cache, "src")
        else:
            index = torch.tensor(plan.src)
            body = [flat_bytes(k_cache[:, index]), flat_bytes(v_cache[:, index])]
        return plan.header(meta), body

    async def push_async(self, meta: TransferMeta, k, v, payload: dict) -> None:
        """``push`` off the event loop. A paged push reads the sender's blocks, which are
        freed once it returns: it is awaited to its end (its sends have the transfer's
        deadline, and one that fails closes the channel, so no later byte can reach the
        receiver), never given up on while it may still read them."""
        if "blocks" in payload:
            await self._submit(self.push, meta, k, v, payload)
        else:
            await super().push_async(meta, k, v, payload)

    def close(self) -> None:
        """Close every channel (worker shutdown)."""
        with self._lock:
            outgoing = list(self._out.values())
            self._out.clear()
        channels = self._in.clear()
        for out in outgoing:
            with out.state:
                channels += [c for c in out.live.values() if c is not None]
                out.live.clear()
        for c in channels:
            c.close()
