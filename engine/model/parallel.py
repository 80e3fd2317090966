"""Tensor parallelism inside one worker: which slice of the model a rank holds, and the
collectives its ranks run together.

A worker at ``tensor_parallel_size`` N is N ranks. Each holds 1/N of every projection
(Megatron's split: q/k/v and gate/up by output rows, o and down by input columns, the
embedding and the LM head by vocabulary rows) and 1/N of the KV heads; with fewer KV heads
than ranks each KV head is held by N / num_kv_heads ranks, as vLLM does. Each layer then
needs one all-reduce after attention and one after the MLP, the embedding one all-reduce,
and the logits one all-gather.

``TPGroup`` is what the model and the runner call; ``SingleRank`` is the group of one (no
collective runs), ``GlooGroup`` the CPU group over ``torch.distributed``'s gloo, built on
a rendezvous store without ``init_process_group`` (no global state: several groups can
live in one process, as the tests start them). The GPU group over NCCL through cupy has
the same interface (``engine.model.nccl``).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TPGroup(Protocol):
    """The collectives of one worker's ranks. Every rank calls each in the same order."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, in place (returned for chaining)."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along ``dim``, rank order."""
        ...

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (other ranks pass nothing): a step's runner input."""
        ...

    def close(self) -> None: ...


class SingleRank:
    """The group of one: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any = None) -> Any:
        return obj

    def close(self) -> None:
        pass


SINGLE = SingleRank()


class GlooGroup:
    """The ranks' gloo group on CPU tensors. ``store`` is a ``torch.distributed`` store
    every rank reaches (rank 0 usually hosts a ``TCPStore``); ``prefix`` keeps this group's
    keys apart from any other group on the same store. Building blocks until every rank
    has built its side, or raises at ``timeout_s``."""

    def __init__(self, store, rank: int, size: int, prefix: str = "tp", timeout_s: float = 60.0) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.rank, self.size = rank, size
        self._pg = ProcessGroupGloo(PrefixStore(prefix, store), rank, size, datetime.timedelta(seconds=timeout_s))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._pg.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        # Two broadcasts: the pickle's length, then its bytes.
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self._pg.broadcast(length, 0).wait()
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
        self._pg.broadcast(buf, 0).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def close(self) -> None:
        self._pg = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Shard:
    """Which part of the model a rank holds: its ``rank`` of ``size``. Pure arithmetic on
    the model's head and vocabulary counts, shared by the loader, the model, the KV cache
    and the KV transfer (which reads exactly the KV heads a rank owns)."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of ``total`` items split evenly (``what`` names them in
        the error when they do not split)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) must divide by tensor_parallel_size ({self.size})")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads this rank holds, [start, stop): 1/size of them, or, with fewer KV
        heads than ranks, the one head its group of size / num_kv_heads ranks shares."""
        return kv_head_range(num_kv_heads, self.size, self.rank)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the embedding and the LM head: the vocabulary padded up to a
        multiple of ``size``, cut evenly (the padding rows are zero and their logits cut)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, (self.rank + 1) * per


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """The KV heads rank ``rank`` of ``size`` holds, [start, stop)."""
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide by tensor_parallel_size ({size})")
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({size}) must be a multiple of num_key_value_heads ({num_kv_heads}) "
            "when it is larger (each KV head is then replicated on size / heads ranks)"
        )
    head = rank // (size // num_kv_heads)
    return head, head + 1


def shard_of(group: TPGroup) -> Shard:
    """The part of the model ``group``'s own rank holds."""
    return Shard(group.rank, group.size)
