"""The tensors behind the block pool: paged K and V for every layer, plus swap space.

Layout: ``k`` and ``v`` are ``[num_layers, num_blocks, block_size, num_kv_heads,
head_dim]``, so ``k[layer]`` is one layer's paged cache and ``k[:, ids]`` is all of a
request's KV in one gather (what a transfer packs into a single message). The swap
pool has the same layout in CPU memory (pinned when the cache is on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model_config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_cpu_blocks: int = 0,
    ) -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: padded attention multiplies masked V rows by 0, and a NaN
        # left in unused memory would turn that into NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        cpu_shape = (shape[0], num_cpu_blocks, *shape[2:])
        pin = torch.device(device).type == "cuda"
        self.cpu_k = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self.cpu_v = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (device block, cpu block) pairs into swap space."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k.device)
        dst = torch.tensor([p[1] for p in pairs])
        self.cpu_k[:, dst] = self.k[:, src].cpu()
        self.cpu_v[:, dst] = self.v[:, src].cpu()

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (cpu block, device block) pairs back from swap space."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs], device=self.k.device)
        self.k[:, dst] = self.cpu_k[:, src].to(self.k.device, non_blocking=True)
        self.v[:, dst] = self.cpu_v[:, src].to(self.v.device, non_blocking=True)
