"""Attention over the paged KV cache: the torch reference backend.

The flattened batch holds decode tokens first (one query per request, sorted by
context length and batched into a few padded attention calls, one per group of
similar lengths, so padding stays small), then prefill chunks (many queries per request,
causal within the chunk, attending to the request's earlier cached blocks).

New K/V are written into the cache through the slot mapping before attention reads
it, so a chunk sees the blocks that other requests in the same step just wrote.
This path runs anywhere torch runs (CPU, or a GPU through torch ops).

Backends: the model runner describes each step as a ``StepLayout`` (plain integers)
and its ``AttentionBackend`` turns that into the metadata its kernels need (both in
``engine/model/step_layout.py``, which every backend imports without importing another); the
layers call the backend through a ``StepAttention``. ``TorchAttention`` here is the
reference; ``engine.model.cpu_attention.CpuAttention`` reads decode rows in place on a
CPU, ``engine.model.triton_attention.TritonAttention`` is the GPU one.
``create_attention_backend`` makes the choice once, when the engine is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.step_layout import ATTENTION_BACKENDS, AttentionBackend, ChunkLayout, StepLayout


@dataclass(frozen=True)
class StepAttention:
    """A backend bound to one step's metadata: the one attention call every layer makes."""

    backend: AttentionBackend
    meta: Any

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, k_cache, v_cache, self.meta, scale, window)


@dataclass
class PrefillChunk:
    """One request's prefill chunk in the flattened batch: its query rows, the context cached
    before it, its block table and its mask (windowed masks made on demand)."""

    q_start: int  # rows of the flattened batch
    q_end: int
    ctx_start: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] long
    mask: torch.Tensor | None  # [q, ctx] bool, None when ctx_start == 0 (plain causal)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # masks by window, made once a step

    def mask_for(self, window: int) -> torch.Tensor | None:
        """The mask of a layer attending to ``window`` latest keys (0: all); None: plain causal."""
        if window == 0 or window >= self.ctx_start + self.q_end - self.q_start:
            return self.mask  # no query has more keys before it than the window
        if window not in self.windowed:
            device = self.block_table.device
            q_pos = torch.arange(self.ctx_start, self.ctx_start + self.q_end - self.q_start, device=device)
            k_pos = torch.arange(self.ctx_start + self.q_end - self.q_start, device=device)
            offset = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
            self.windowed[window] = (offset >= 0) & (offset < window)
        return self.windowed[window]


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended in one padded call."""

    q_start: int
    q_end: int
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with the null block
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool
    lengths: torch.Tensor  # [B] keys per row, the new token included
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # masks by window, made once a step

    def mask_for(self, window: int) -> torch.Tensor:
        """The mask of a layer attending to ``window`` latest keys (0: all)."""
        if window == 0:
            return self.mask
        if window not in self.windowed:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            first = (self.lengths - window).unsqueeze(1)
            self.windowed[window] = self.mask & (keys.unsqueeze(0) >= first)[:, None, None, :]
        return self.windowed[window]


class GatherWorkspace:
    """Reused output buffers for gathering K and V out of the paged cache.

    A step gathers tens of MB per layer. Fresh tensors that large are mapped anew by
    the allocator on every call and page-faulted in, which measured slower than the
    attention itself; two buffers kept for the engine's life avoid that.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def buffer(self, slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[slot] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]


@dataclass
class AttentionMetadata:
    """What ``TorchAttention`` (and ``CpuAttention``) make of one step's layout: where new K/V go,
    and the decode groups and prefill chunks to attend; built once a step for all layers."""

    slot_mapping: torch.Tensor  # [T] long: where each token's K/V goes in the cache
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    workspace: GatherWorkspace | None = None
    paged_decode: Any = None  # engine.model.cpu_attention.PagedDecode: decode rows for its kernel


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter new K/V rows ([T, Hkv, D]) into one layer's cache ([N, block, Hkv, D])."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def _gather(
    cache: torch.Tensor, block_table: torch.Tensor, workspace: GatherWorkspace | None = None, slot: int = 0
) -> torch.Tensor:
    """[..., nb] block ids -> [..., Hkv, nb * block, D] keys or values."""
    num_blocks, block, heads, dim = cache.shape
    flat = cache.view(num_blocks, -1)
    index = block_table.reshape(-1)
    # index_select on a 2-D view is several times faster than advanced indexing on CPU.
    if workspace is None:
        g = flat.index_select(0, index)
    else:
        out = workspace.buffer(slot, index.numel() * flat.shape[1], cache).view(index.numel(), flat.shape[1])
        g = torch.index_select(flat, 0, index, out=out)
    g = g.view(*block_table.shape[:-1], block_table.shape[-1] * block, heads, dim)
    return g.transpose(-3, -2)


class TorchAttention(AttentionBackend):
    """The reference backend: gathers K/V per decode group or chunk and calls SDPA."""

    name = "torch"
    write_kv = staticmethod(write_kv)

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._workspace = GatherWorkspace()

    def build_metadata(self, layout: StepLayout) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(layout.slots, dtype=torch.long, device=self.device),
            decodes=self._decode_groups(layout.decode_block_table, layout.decode_context_lens),
            prefills=[self._chunk(c) for c in layout.chunks],
            workspace=self._workspace,
        )

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, window: int = 0) -> None:
        self._attend_decodes(q, k_cache, v_cache, meta, scale, out, window)
        self._attend_chunks(q, k, v, k_cache, v_cache, meta, scale, out, window)

    def _attend_decodes(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, window: int) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        for g in meta.decodes:
            b = g.q_end - g.q_start
            # One query per row: fold each KV head's query group into the query axis,
            # so K and V are never repeated per query head.
            qd = q[g.q_start : g.q_end].view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
            kd = _gather(k_cache, g.block_tables, meta.workspace, 0)
            vd = _gather(v_cache, g.block_tables, meta.workspace, 1)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask_for(window), scale=scale)
            out[g.q_start : g.q_end] = od.reshape(b, num_heads, head_dim)

    def _attend_chunks(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, window: int
                       ) -> None:
        for c in meta.prefills:
            qc = q[c.q_start : c.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            mask = c.mask_for(window)
            if c.ctx_start == 0:  # the chunk's own keys are all there is
                kc = k[c.q_start : c.q_end].transpose(0, 1).unsqueeze(0)
                vc = v[c.q_start : c.q_end].transpose(0, 1).unsqueeze(0)
                oc = F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
                )
            else:
                ctx = mask.shape[1]
                kc = _gather(k_cache, c.block_table, meta.workspace, 0)[:, :ctx].unsqueeze(0)
                vc = _gather(v_cache, c.block_table, meta.workspace, 1)[:, :ctx].unsqueeze(0)
                oc = F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[c.q_start : c.q_end] = oc.squeeze(0).transpose(0, 1)

    def _decode_groups(self, table: np.ndarray, lens: list[int]) -> list[DecodeGroup]:
        """Split decode rows (sorted by length) where padding would pass ~1.5x the data."""
        bs = self.block_size
        groups, start = [], 0
        for i in range(1, len(lens) + 1):
            if i < len(lens) and lens[i] <= 1.5 * lens[start] + 4 * bs:
                continue
            width = -(-max(lens[start:i]) // bs)
            rows = np.ascontiguousarray(table[start:i, :width])
            lengths = torch.tensor(lens[start:i], device=self.device)
            keys = torch.arange(width * bs, device=self.device)
            groups.append(
                DecodeGroup(
                    q_start=start,
                    q_end=i,
                    block_tables=torch.from_numpy(rows).to(self.device),
                    mask=(keys.unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :],
                    lengths=lengths,
                )
            )
            start = i
        return groups

    def _chunk(self, chunk: ChunkLayout) -> PrefillChunk:
        start, n = chunk.start, chunk.num_tokens
        ctx = start + n
        nb = -(-ctx // self.block_size)
        block_table = torch.tensor(chunk.block_ids[:nb], dtype=torch.long, device=self.device)
        mask = None
        if start > 0:
            q_pos = torch.arange(start, ctx, device=self.device).unsqueeze(1)
            k_pos = torch.arange(ctx, device=self.device).unsqueeze(0)
            mask = k_pos <= q_pos
        return PrefillChunk(chunk.row0, chunk.row0 + n, start, block_table, mask)


def resolve_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """``auto``: triton on a CUDA device when triton imports; on the CPU, the C kernel
    (``cpu``) for float32 when it builds here; torch otherwise."""
    if name != "auto":
        return name
    if torch.device(device).type == "cpu":
        if dtype != torch.float32:
            return "torch"
        from engine.model.cpu_attention import kernel_available

        return "cpu" if kernel_available() else "torch"
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def create_attention_backend(
    name: str, device: torch.device | str, block_size: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """The engine's one attention backend, chosen from the ``attention_backend`` setting."""
    device = torch.device(device)
    resolved = resolve_attention_backend(name, device, dtype)
    if resolved == "torch":
        return TorchAttention(block_size, device)
    # Imported here: these backends build on this module's types.
    if resolved == "cpu":
        from engine.model.cpu_attention import CpuAttention

        if dtype != torch.float32:
            raise ValueError(f"attention_backend='cpu' runs float32, got dtype {dtype}")
        return CpuAttention(block_size, device)
    if resolved == "triton":
        from engine.model.triton_attention import TritonAttention

        return TritonAttention(block_size, device, head_dim)
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
