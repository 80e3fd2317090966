"""Collective backend: point-to-point send/recv with ``ray.util.collective``.

NCCL (through cupy) when ``torch.cuda.is_available()``, gloo otherwise. On this Ray
version gloo sits on ``torch.distributed``, so a process belongs to one group at a
time: the group spans every prefill and decode worker and is rebuilt (all members
leave, then join with new ranks) whenever a worker joins or dies. ``GroupMember`` is
the part of a worker that takes part in that.

K and V go as two messages of raw bytes (any dtype, bfloat16 included) into staging
buffers on the receiver, which then scatters them into its paged blocks with one
indexed copy. Staging buffers are kept and reused (``recycle``): fresh ones cost a
page fault per 4 KiB, which measured slower than the transfer itself.

Point-to-point messages between two ranks are matched in the order they are posted,
so both sides must handle a pair's transfers in the same order: the sender numbers
its transfers per destination when it prepares them and pushes them in that order;
the receiver pulls them from each source in the same order. A transfer whose caller
gave up (deadline) still completes its send or receive in the background, so the
sequence never skips.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta

GROUP_NAME = "default"  # the gloo backend tears down only the default group fully


def device_backend() -> str:
    """NCCL on GPUs, gloo otherwise (``nccl_available()`` can be true without a GPU)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class GroupMember:
    """This process's membership of the transfer group."""

    def __init__(self, op_timeout_s: float = 60.0) -> None:
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self.backend = device_backend()
        self.op_timeout_ms = int(op_timeout_s * 1000)

    @property
    def joined(self) -> bool:
        return self.rank >= 0

    def join(self, world_size: int, rank: int, generation: int) -> None:
        """Blocks until every member of the new group has joined."""
        from ray.util import collective

        self.leave()
        collective.init_collective_group(
            world_size, rank, backend=self.backend, group_name=GROUP_NAME,
            gloo_timeout=self.op_timeout_ms,
        )
        self.rank, self.world_size, self.generation = rank, world_size, generation

    def leave(self) -> None:
        from ray.util import collective

        if collective.is_group_initialized(GROUP_NAME):
            collective.destroy_collective_group(GROUP_NAME)
        self.rank, self.world_size = -1, 0


class CollectiveBackend(KVTransferBackend):
    name = "collective"

    def __init__(self, member: GroupMember | None = None) -> None:
        super().__init__()
        self.member = member or GroupMember()
        self._turn = threading.Condition()
        self._generation = -1
        self._assigned: dict[int, int] = defaultdict(int)  # dst rank -> next seq to hand out
        self._done: dict[tuple[str, int], int] = defaultdict(int)  # (send|recv, peer) -> next seq
        self._active = 0  # operations running on the current group
        self._regrouping = False
        self._staging = StagingPool()

    @property
    def rank(self) -> int:
        return self.member.rank

    def join(self, world_size: int, rank: int, generation: int) -> None:
        """Rebuild the group once the operations on the old one are done (or timed out).

        Meanwhile no operation may start: one that started on the new group with a
        peer rank of the old would exchange another request's KV with whoever holds
        that rank now.
        """
        with self._turn:
            self._regrouping = True
            self._turn.notify_all()  # waiting transfers give up
            self._turn.wait_for(lambda: self._active == 0, timeout=self.member.op_timeout_ms / 1000 + 5)
        try:
            self.member.join(world_size, rank, generation)
        finally:
            with self._turn:
                self._regrouping = False
                self._turn.notify_all()

    def _reset_if_regrouped(self) -> None:
        if self._generation != self.member.generation:
            self._generation = self.member.generation
            self._assigned.clear()
            self._done.clear()

    def prepare(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor) -> dict:
        if not self.member.joined:
            raise TransferError("no_group", "this worker is not in a transfer group")
        with self._turn:
            self._reset_if_regrouped()
            seq = self._assigned[meta.dst_rank]
            self._assigned[meta.dst_rank] += 1
        return {"src_rank": self.member.rank, "generation": self.member.generation, "seq": seq}

    def _in_turn(self, direction: str, peer: int, payload: dict, op) -> None:
        """Run ``op`` when every earlier transfer with ``peer`` in this direction is done."""
        key = (direction, peer)
        with self._turn:
            self._reset_if_regrouped()
            current = lambda: payload["generation"] == self.member.generation and not self._regrouping  # noqa: E731
            if not current():
                raise TransferError("group_changed", "the transfer group was rebuilt mid-transfer")
            self._turn.wait_for(lambda: self._done[key] >= payload["seq"] or not current())
            # Checked again after the wait: the group may have been rebuilt meanwhile.
            if not current():
                raise TransferError("group_changed", "the transfer group was rebuilt mid-transfer")
            self._active += 1
        # The operation itself runs unlocked: transfers with other peers go on meanwhile
        # (one lock over all of them could deadlock prefill and decode workers in a ring).
        try:
            op()
        finally:
            with self._turn:
                self._active -= 1
                if self._generation == payload["generation"]:  # not a newer group's counters
                    self._done[key] = payload["seq"] + 1
                self._turn.notify_all()

    def push(self, meta: TransferMeta, k: torch.Tensor, v: torch.Tensor, payload: dict) -> None:
        from ray.util import collective

        def send() -> None:
            for t in (k, v):
                collective.send(_as_bytes(t), meta.dst_rank, GROUP_NAME)

        t0 = time.perf_counter()
        self._in_turn("send", meta.dst_rank, payload, send)
        self.stats.sent += 1
        self.stats.bytes_sent += k.nbytes + v.nbytes
        self.stats.seconds_sending += time.perf_counter() - t0

    def pull(self, meta: TransferMeta, payload: dict) -> tuple[torch.Tensor, torch.Tensor]:
        from ray.util import collective

        dtype = getattr(torch, meta.layout.dtype)
        device = "cuda" if self.member.backend == "nccl" else "cpu"
        shape = meta.layout.packed_shape(meta.num_blocks)
        k = self._staging.take(shape, dtype, device)
        v = self._staging.take(shape, dtype, device)
        def recv() -> None:
            for t in (k, v):
                collective.recv(_as_bytes(t), payload["src_rank"], GROUP_NAME)

        t0 = time.perf_counter()
        self._in_turn("recv", payload["src_rank"], payload, recv)
        self.stats.received += 1
        self.stats.bytes_received += k.nbytes + v.nbytes
        self.stats.seconds_receiving += time.perf_counter() - t0
        return k, v


    def recycle(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._staging.give(k)
        self._staging.give(v)


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


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)
