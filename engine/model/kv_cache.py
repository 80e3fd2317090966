"""The tensors behind the block pool: paged K and V for every layer, plus swap space.

Layout: ``k`` and ``v`` are ``[num_layers, num_blocks, block_size, num_kv_heads,
head_dim]``, so ``k[layer]`` is one layer's paged cache and ``k[:, ids]`` is all of a
request's KV in one gather (what a transfer packs into a single message). The swap
pool has the same layout in CPU memory (pinned when the cache is on a GPU). Under tensor
parallelism a rank's cache holds only the KV heads its shard owns (``Shard.kv_heads``).

Whole blocks move in and out only through ``gather`` and ``scatter`` (KV packed for a
transfer or received from one, swap). The attention backends read and write ``k`` and
``v`` in place, and a paged transfer backend registers them to read blocks directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.model_config import ModelConfig
from engine.model.parallel import Shard, kv_head_range


def kv_heads_per_rank(config: ModelConfig, tp_size: int = 1) -> int:
    """The KV heads each rank of ``tp_size`` holds (every rank holds as many)."""
    start, stop = kv_head_range(config.num_kv_heads, tp_size, 0)
    return stop - start


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """K and V of one block across all layers, on each rank of ``tp_size``."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * kv_heads_per_rank(config, tp_size) * config.head_dim * elem


class KVCache:
    """One engine's paged K and V tensors for every layer, and their CPU swap space; allocated when
    the engine is built and kept for its life. Which request owns which block is the block
    manager's business (``engine.core.block_pool``). With ``tp``, only that shard's KV heads."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_cpu_blocks: int = 0,
        tp: Shard | None = None,
    ) -> None:
        heads = kv_heads_per_rank(config, 1 if tp is None else tp.size)
        shape = (config.num_layers, num_blocks, block_size, heads, config.head_dim)
        # Zeros, not empty: padded attention multiplies masked V rows by 0, and a NaN
        # left in unused memory would turn that into NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Swap space is empty, not zeros: swap_out writes a block before swap_in reads
        # it, and on the CPU pages never touched take no memory, so the swap space
        # (EngineConfig.swap_space, 0.5 GiB by default) costs nothing until preemption
        # uses it.
        cpu_shape = (shape[0], num_cpu_blocks, *shape[2:])
        pin = torch.device(device).type == "cuda"
        self.cpu_k = torch.empty(cpu_shape, dtype=dtype, pin_memory=pin)
        self.cpu_v = torch.empty(cpu_shape, dtype=dtype, pin_memory=pin)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_ids``, in that order: ``[layers, len(block_ids), block, Hkv, D]``
        each, copied out of the cache in one indexed read."""
        index = torch.tensor(block_ids, device=self.k.device)
        return self.k[:, index], self.v[:, index]

    def scatter(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> None:
        """Write ``k``/``v`` (laid out as ``gather`` returns them, on any device and in any
        dtype) into ``block_ids``; ValueError if their shape does not fit."""
        if k.shape[1] != len(block_ids) or k.shape[2:] != self.k.shape[2:] or v.shape != k.shape:
            raise ValueError(
                f"received KV of shape {tuple(k.shape)} does not fit {len(block_ids)} blocks of "
                f"{tuple(self.k.shape[2:])}"
            )
        index = torch.tensor(block_ids, device=self.k.device)
        self.k[:, index] = k.to(self.k.device, self.k.dtype, non_blocking=non_blocking)
        self.v[:, index] = v.to(self.v.device, self.v.dtype, non_blocking=non_blocking)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (device block, cpu block) pairs into swap space."""
        if not pairs:
            return
        k, v = self.gather([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        self.cpu_k[:, dst] = k.cpu()
        self.cpu_v[:, dst] = v.cpu()

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (cpu block, device block) pairs back from swap space."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs])
        self.scatter([p[1] for p in pairs], self.cpu_k[:, src], self.cpu_v[:, src], non_blocking=True)
