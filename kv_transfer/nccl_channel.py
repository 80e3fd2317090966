"""The collective backend's NCCL pair channel: a transfer's body goes device to device over
a two-rank NCCL communicator made through cupy's bindings (``engine.model.nccl``'s loader
and rendezvous); its header, and the receiver's answer to it, go over the pair's gloo
channel with the same tags, deadlines and refusal rules as a gloo pair's.

NCCL matches a pair's sends and receives in the order they are posted, not by tag, so the
receiver decides that order. Per transfer::

    sender                                  receiver
    header ───────── gloo, tag t ─────────▶ compares it with its own view
                                            refused: answers 0 ──┐  accepted: takes the channel's
    waits for the answer ◀──── gloo, tag t+1 ───────────────────┘  turn, answers 1, posts its receives
    1: posts its sends ═══════ NCCL ══════▶ the body lands; the turn passes on
    0: returns; nothing was sent

The receiver gives the turn to one transfer at a time and holds it until that transfer's
receives have completed, so both sides post a pair's NCCL operations in the same order
whatever order the transfers come in. A refused transfer costs one word, not a drain.

Deadlines: the gloo steps wait as on a gloo channel. NCCL's own operations have none (a
receive whose sender died never completes), so each side polls its group call's completion
event until the transfer's time is up and then closes the channel: ``ncclCommAbort`` ends
the communicator's pending operations (no byte lands once it returns), and closing the gloo
channel fails the peer's pending steps. As on gloo, a failure after a body was posted
closes the channel; one before leaves it whole.

NCCL allows no two ranks of one communicator on the same device, so a pair needs two GPUs.
Both ends make the communicator when they build the channel, in the same rendezvous store
under the channel's prefix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kv_transfer.base import TransferError
from kv_transfer.collective_channels import Channel, TransferRefused, flat_bytes

POLL_S = (0.0002, 0.005)  # a completion's polls start at the first and back off to the second
GO, NO = 1, 0  # the receiver's answer to a header
# How long past the transfer's deadline the sender waits for the receiver's answer, and a
# "no" sent at the deadline waits for the sender's receive of it.
ANSWER_S = 1.0


class NcclPair:
    """cupy's two-rank NCCL communicator of one channel, with a CUDA stream of its own."""

    def __init__(self, store, rank: int, timeout_s: float, device: torch.device) -> None:
        from engine.model.nccl import exchange_unique_id, load_nccl

        if device.type != "cuda":
            raise TransferError("connect", f"an NCCL channel moves CUDA memory; this side's cache is on {device}")
        nccl = load_nccl()
        self._nccl, self.peer, self.device = nccl, 1 - rank, device
        unique_id = exchange_unique_id(store, rank, 2, nccl.get_unique_id, timeout_s)
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device)
            self._comm = nccl.NcclCommunicator(2, unique_id, rank)
        self._lock = threading.Lock()  # a communicator takes one thread's calls at a time

    def post(self, op: str, tensors: list[torch.Tensor]) -> Callable[[], bool]:
        """Send or receive these byte tensors as one group call on the pair's stream, after
        the work queued so far on the current one (the cache writes a send reads); returns
        the poll of its completion."""
        with self._lock:
            if self._comm is None:
                raise TransferError("channel_closed", "the channel's NCCL communicator was aborted")
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            call = self._comm.send if op == "send" else self._comm.recv
            self._nccl.groupStart()
            try:
                for t in tensors:
                    call(t.data_ptr(), t.numel(), self._nccl.NCCL_UINT8, self.peer, stream.cuda_stream)
            finally:
                self._nccl.groupEnd()
            for t in tensors:
                t.record_stream(stream)  # the caching allocator keeps them until the call ends
            done = torch.cuda.Event()
            done.record(stream)
        return done.query

    def abort(self) -> None:
        """``ncclCommAbort``: pending operations end, and none writes once it returns."""
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            with torch.cuda.device(self.device):
                comm.abort()


class NcclChannel:
    """A pair's gloo ``Channel`` for headers and answers, and an ``NcclPair`` for bodies
    (the module docstring has a transfer's steps). Bodies are device memory on ``device``."""

    def __init__(self, store, prefix: str, rank: int, timeout_s: float, device: torch.device) -> None:
        from torch.distributed import PrefixStore

        self._gloo = Channel(store, prefix, rank, timeout_s)
        try:
            self._pair = NcclPair(PrefixStore(f"{prefix}/nccl", store), rank, timeout_s, device)
        except BaseException:
            self._gloo.close()
            raise
        self.device = device
        self.on_device = True
        self._turn = threading.Lock()  # the receiver's: one transfer's body on the communicator at a time

    @property
    def closed(self) -> bool:
        return self._gloo.closed

    def send_transfer(self, header: torch.Tensor, body: list[torch.Tensor], tag: int, timeout_s: float) -> bool:
        """The header, then the body once the receiver says go; False if it said no."""
        deadline = time.monotonic() + timeout_s
        self._gloo.exchange("send", [header], tag, timeout_s)
        answer = torch.zeros(1, dtype=torch.int64)
        # A no may come as late as the deadline itself (a receive that waited for the turn).
        self._gloo.exchange("recv", [answer], tag + 1, _left(deadline, "its answer") + ANSWER_S)
        if int(answer) != GO:
            return False
        self._await(self._pair.post("send", [flat_bytes(t) for t in body]), deadline, "send")
        return True

    def receive_header(self, header: torch.Tensor, tag: int, timeout_s: float) -> None:
        self._gloo.exchange("recv", [header], tag, timeout_s)

    def receive_body(self, body: list[torch.Tensor], tag: int, timeout_s: float) -> None:
        """Take the turn, say go, and receive the body into ``body`` (device byte views).
        A transfer whose time runs out waiting for the turn is answered no: it fails alone."""
        deadline = time.monotonic() + timeout_s
        if not self._turn.acquire(timeout=max(timeout_s, 0.0)):
            self.refuse_body(None, tag, ANSWER_S)
            raise TransferRefused("timeout", "the transfer passed its deadline waiting for the channel's turn")
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                self.refuse_body(None, tag, ANSWER_S)
                raise TransferRefused("timeout", "the transfer passed its deadline waiting for the channel's turn")
            self._gloo.exchange("send", [torch.tensor([GO])], tag + 1, left)
            self._await(self._pair.post("recv", body), deadline, "receive")
        finally:
            self._turn.release()

    def refuse_body(self, header: torch.Tensor | None, tag: int, timeout_s: float) -> None:
        """Answer no: the sender sends nothing more."""
        self._gloo.exchange("send", [torch.tensor([NO])], tag + 1, timeout_s)

    def close(self) -> None:
        """Abort the communicator (no byte lands after), then close the gloo channel (the
        peer's pending steps fail)."""
        self._pair.abort()
        self._gloo.close()

    def _await(self, done: Callable[[], bool], deadline: float, what: str) -> None:
        """Poll a group call's completion until ``deadline``; past it, raise (the caller
        closes the channel, which aborts the call)."""
        pause = POLL_S[0]
        while not done():
            if self.closed:
                raise TransferError("channel_closed", f"the channel closed during the body's {what}")
            if time.monotonic() >= deadline:
                raise TransferError("timeout", f"the body's NCCL {what} passed its deadline")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError("timeout", f"the transfer passed its deadline before {what}")
    return left
