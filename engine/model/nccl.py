"""Tensor parallelism on GPUs: the ranks' collectives over NCCL, through cupy's bindings.

``NcclGroup`` is the ``TPGroup`` (``engine.model.parallel``) of one worker's ranks when
they run on CUDA, one rank per GPU. Its life:

    build ─▶ rank 0 publishes NCCL's unique id in the store ─▶ every rank has the id and
    checks in ─▶ ncclCommInitRank (blocks until every rank is in) ─▶ collectives ─▶ close
    (ncclCommAbort)

Each collective is one NCCL call on torch's current CUDA stream of the group's device,
given the tensor's pointer, its element count and its NCCL data type, so it orders with
the kernels around it like any other launch and the caching allocator's stream rules
keep its buffers alive. ``broadcast_object`` (a step's runner input, a Python object)
goes over a ``GlooGroup`` on the same store: NCCL moves device memory only.

The rendezvous: NCCL's own init has no deadline (a rank whose peer never comes waits for
ever), so the ranks first meet in the store, where every wait ends at ``timeout_s``: a
peer that never started fails the build with a ``TimeoutError`` that names the ranks
missing. A ``prefix`` names one group's life on a store: a rebuilt group takes a new one
(old keys would hand it the old unique id). Past the rendezvous NCCL has no deadline
either: a collective whose peer died never completes on the device, and what waits on
its result (a step's sampled tokens) waits with it; the CPU side channel's broadcasts
do time out.

Why cupy: the design card's choice. cupy's ``cupy.cuda.nccl`` is a thin binding of the
NCCL C API (communicator, collectives, send/recv, group calls) that owns no process
state, so a group is an object like ``GlooGroup`` (several may live in one process, as
the tests start them) and nothing calls ``init_process_group``. torch's
``ProcessGroupNCCL``, built on a store the same way, would also work, and may be the one
to take once steps above one rank replay CUDA graphs (today they run eagerly; the GPU
tests check that cupy's all-reduce captures and replays) or are traced by torch's
compiler, whose tooling knows torch's collectives and not foreign calls.

cupy is imported on the first ``NcclGroup`` (CPU workers never import it), after torch
(this module imports it): torch's CUDA wheel has loaded ``libnccl.so.2`` (nvidia-nccl-cu13)
by then, which satisfies cupy's binding where cupy finds no NCCL of its own. The GPU
tests record which NCCL version runs.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
from collections.abc import Callable
from typing import Any

import torch

from engine.model.parallel import GlooGroup

NCCL_UNIQUE_ID_BYTES = 128

# torch dtype -> the name of NCCL's data type in cupy.cuda.nccl. No bool: NCCL sums it as
# uint8, which wraps at 256 ranks and is not torch's logical or.
_NCCL_DTYPE_NAMES = {
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
}

# cupy hands the unique id out, and takes it back, as C chars: signed on x86, unsigned on
# Arm and POWER.
CHAR_IS_SIGNED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def load_nccl() -> Any:
    """cupy's NCCL binding (``cupy.cuda.nccl``), or an error that says why it cannot load."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(f"NcclGroup needs cupy with NCCL (the `gpu` extra's cupy-cuda13x): {e}") from e
    if not getattr(nccl, "available", True):
        raise RuntimeError("cupy is installed but its NCCL binding is not available (no libnccl.so.2 found)")
    return nccl


def nccl_dtypes(nccl: Any) -> dict[torch.dtype, int]:
    """torch dtype -> NCCL's data type, for the types this cupy build names."""
    return {dtype: getattr(nccl, name) for dtype, name in _NCCL_DTYPE_NAMES.items() if hasattr(nccl, name)}


def encode_unique_id(unique_id: tuple[int, ...]) -> bytes:
    """NCCL's unique id (cupy's tuple of C chars) as the bytes the store keeps."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    return bytes(b & 0xFF for b in unique_id)


def decode_unique_id(data: bytes, signed: bool = CHAR_IS_SIGNED) -> tuple[int, ...]:
    """The store's bytes back as the tuple of C chars ``NcclCommunicator`` takes."""
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return tuple(b - 256 if signed and b > 127 else b for b in data)


def exchange_unique_id(
    store, rank: int, size: int, make_id: Callable[[], tuple[int, ...]], timeout_s: float
) -> tuple[int, ...]:
    """Rank 0's ``make_id()`` on every rank, once every rank holds it.

    Rank 0 publishes the id; the others wait for it; then each checks in and waits for all
    the others' check-ins, so that the blocking NCCL init starts only when every rank has
    reached it. Each wait ends at ``timeout_s`` with a ``TimeoutError`` naming who is
    missing. ``store`` is this group's own (a ``PrefixStore``)."""
    if rank == 0:
        store.set("unique_id", encode_unique_id(make_id()))
    else:
        _wait(store, ["unique_id"], timeout_s, f"rank {rank} of {size}: rank 0's NCCL unique id")
    unique_id = decode_unique_id(store.get("unique_id"))
    store.set(f"ready/{rank}", b"1")
    keys = [f"ready/{r}" for r in range(size)]
    _wait(store, keys, timeout_s, f"rank {rank} of {size}: every rank's check-in")
    return unique_id


def _wait(store, keys: list[str], timeout_s: float, what: str) -> None:
    """Wait for ``keys`` in ``store`` until ``timeout_s``; raise TimeoutError naming the missing."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # torch's DistStoreError is one
        missing = [k for k in keys if not store.check([k])]
        raise TimeoutError(f"NCCL group rendezvous, {what}: {missing} not there after {timeout_s}s") from e


def gathered_along(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``[size, *shape]`` (rank r's tensor at index r) as the ranks' tensors concatenated
    along ``dim`` of ``shape``, in rank order (a view when ``dim`` is the first)."""
    shape = stacked.shape[1:]
    d = dim % len(shape)
    joined = stacked.shape[0] * shape[d]
    return stacked.movedim(0, d).reshape(*shape[:d], joined, *shape[d + 1 :])


class NcclGroup:
    """The ranks' NCCL group on CUDA tensors of ``device`` (default: the current CUDA
    device), one rank per device. ``store`` is a ``torch.distributed`` store every rank
    reaches; ``prefix`` keeps this group's keys apart from any other group's. Building
    blocks until every rank has built its side, or raises at ``timeout_s``."""

    def __init__(self, store, rank: int, size: int, prefix: str = "tp", timeout_s: float = 60.0, device=None) -> None:
        from torch.distributed import PrefixStore

        nccl = load_nccl()
        self.rank, self.size = rank, size
        self.device = _resolve_device(device)
        self._nccl = nccl
        self._dtypes = nccl_dtypes(nccl)
        self._sum = nccl.NCCL_SUM
        unique_id = exchange_unique_id(PrefixStore(f"{prefix}/nccl", store), rank, size, nccl.get_unique_id, timeout_s)
        self._cpu: GlooGroup | None = GlooGroup(store, rank, size, prefix=f"{prefix}/cpu", timeout_s=timeout_s)
        with self._on_device():
            self._comm = nccl.NcclCommunicator(size, unique_id, rank)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, in place (returned for chaining)."""
        buf = self._checked(tensor).contiguous()
        if buf.numel():
            ptr = buf.data_ptr()
            self._comm.allReduce(ptr, ptr, buf.numel(), self._dtype(buf), self._sum, self._stream())
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along ``dim``, rank order: one ncclAllGather
        into a ``[size, *shape]`` buffer, whose leading dimension then moves to ``dim``."""
        src = self._checked(tensor).contiguous()
        if src.dim() == 0:
            raise ValueError("all_gather needs a tensor of at least one dimension to join along")
        out = torch.empty((self.size, *src.shape), dtype=src.dtype, device=src.device)
        if src.numel():
            self._comm.allGather(src.data_ptr(), out.data_ptr(), src.numel(), self._dtype(src), self._stream())
        return gathered_along(out, dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank, over the group's CPU side channel."""
        if self._cpu is None:
            raise RuntimeError("the NCCL group is closed")
        return self._cpu.broadcast_object(obj)

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, peer: int) -> torch.Tensor:
        """Send ``send`` to rank ``peer`` and receive ``recv`` (contiguous, filled in
        place) from it, as one NCCL group call: a rank may be its own peer, and two ranks
        exchanging at once cannot deadlock on each other's order."""
        for t in (send, recv):
            self._checked(t)
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("send_recv needs contiguous tensors (recv is filled in place)")
        stream = self._stream()
        self._nccl.groupStart()
        try:
            self._comm.send(send.data_ptr(), send.numel(), self._dtype(send), peer, stream)
            self._comm.recv(recv.data_ptr(), recv.numel(), self._dtype(recv), peer, stream)
        finally:
            self._nccl.groupEnd()
        return recv

    def close(self) -> None:
        """End the communicator with NCCL's abort, which does not wait on queued work: a
        collective whose peer died spins on the device until aborted (``destroy`` would
        wait for it for ever). Close a group only when its results are no longer needed
        (an engine's ranks have stopped, or failed)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            with self._on_device():
                comm.abort()
        if self._cpu is not None:
            self._cpu.close()
            self._cpu = None

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._comm is None:
            raise RuntimeError("the NCCL group is closed")
        if tensor.device != self.device:
            raise ValueError(f"this NCCL group runs on {self.device}, got a tensor on {tensor.device}")
        return tensor

    def _dtype(self, tensor: torch.Tensor) -> int:
        try:
            return self._dtypes[tensor.dtype]
        except KeyError:
            raise TypeError(
                f"NCCL through this cupy has no data type for {tensor.dtype} "
                f"(it has {sorted(str(d) for d in self._dtypes)})"
            ) from None

    def _stream(self) -> int:
        """torch's current stream on the group's device (0, the null stream, off CUDA)."""
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()


def _resolve_device(device) -> torch.device:
    """``device`` with its CUDA index filled in (None: the current CUDA device)."""
    device = torch.device("cuda" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
