"""A stand-in for ``kv_transfer.nccl_channel.NcclPair`` on CPU memory: two ranks of one
process (threads) joined through the channel's rendezvous store, whose sends and receives
match in the order each side posts them, as NCCL's point-to-point calls do (not by tag).

It checks what NCCL would not forgive: a send matched with a receive of another size (two
sides that posted in different orders) is recorded in ``errors`` and never completes. A
rank can be frozen (its sends never leave: a peer that died after it posted), and
``abort`` ends the pair's pending operations: nothing lands after it returns.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque

import torch


class _Op:
    """One posted send or receive, and the group call it belongs to."""

    def __init__(self, tensor: torch.Tensor, call: _Call) -> None:
        self.tensor, self.call = tensor, call


class _Call:
    """A group call's operations: done when every one of them has matched."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.done = threading.Event()
        if count == 0:
            self.done.set()

    def matched(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.done.set()


class _Wire:
    """The two ranks' pending sends (rank 0 to 1; a channel carries one direction) and receives."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sends: deque[_Op] = deque()
        self.recvs: deque[_Op] = deque()
        self.errors: list[str] = []
        self.aborted = False
        self.sent_bytes = 0

    def match(self) -> None:
        while self.sends and self.recvs and not self.aborted:
            send, recv = self.sends[0], self.recvs[0]
            if send.tensor.numel() != recv.tensor.numel():
                self.errors.append(f"a send of {send.tensor.numel()} bytes met a receive of {recv.tensor.numel()}")
                return
            self.sends.popleft()
            self.recvs.popleft()
            recv.tensor.copy_(send.tensor)
            self.sent_bytes += send.tensor.numel()
            send.call.matched()
            recv.call.matched()


class FakeNcclPair:
    """``NcclPair``'s interface over a ``_Wire``; ``wires`` holds every pair made, by id."""

    wires: dict[str, _Wire] = {}
    frozen_senders = False  # set: rank 0's sends are posted but never leave
    posts: list[tuple[int, str, int]] = []  # (rank, op, tensors) of every group call

    def __init__(self, store, rank: int, timeout_s: float, device: torch.device) -> None:
        import datetime

        if rank == 0:
            wire_id = uuid.uuid4().hex
            FakeNcclPair.wires[wire_id] = _Wire()
            store.set("fake-wire", wire_id)
        store.wait(["fake-wire"], datetime.timedelta(seconds=timeout_s))
        self.wire = FakeNcclPair.wires[store.get("fake-wire").decode()]
        self.rank, self.device = rank, device

    def post(self, op: str, tensors: list[torch.Tensor]):
        assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in tensors), "the pair moves flat bytes"
        FakeNcclPair.posts.append((self.rank, op, len(tensors)))
        call = _Call(len(tensors))
        with self.wire.lock:
            if self.wire.aborted:
                raise RuntimeError("NCCL communicator aborted")
            if op == "send" and FakeNcclPair.frozen_senders:
                return call.done.is_set
            queue = self.wire.sends if op == "send" else self.wire.recvs
            queue.extend(_Op(t, call) for t in tensors)
            self.wire.match()
        return call.done.is_set

    def abort(self) -> None:
        with self.wire.lock:
            self.wire.aborted = True
            self.wire.sends.clear()
            self.wire.recvs.clear()

    @classmethod
    def reset(cls) -> type[FakeNcclPair]:
        cls.wires, cls.frozen_senders, cls.posts = {}, False, []
        return cls
