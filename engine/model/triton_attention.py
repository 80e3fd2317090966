"""Attention over the paged KV cache in Triton: the GPU backend.

Every kernel reads K/V straight from the paged blocks through a block table (no
gather copy), keeps the softmax online in fp32, and takes fp16, bf16 or fp32.

- ``_write_kv_kernel``: one program per new token copies its K/V rows into the
  cache slot the slot mapping names.
- ``_decode_kernel``: one query token per request. A program owns one (request, KV
  head, partition): it loads the query rows of all query heads that share the KV
  head (GQA grouping), so each K/V tile is read once for the whole group. A long
  context is split into partitions of ``partition_size`` tokens (flash-decoding,
  vLLM's paged_attention_v2); ``_decode_reduce_kernel`` merges the partitions'
  partial outputs by their max logits and exp sums.
- ``_prefill_kernel``: many query tokens per request. A program owns a tile of
  query tokens of one request times the query heads of one KV head, causal within
  the chunk and attending to every earlier token of the request, which the chunk's
  K/V join in the cache before it runs (a chunk may start mid-block).

Triton is imported guarded: this module imports without it, and ``TritonAttention``
says what is missing when it is built. ``TRITON_INTERPRET=1`` (set before this module
is imported) runs the same kernels in Triton's interpreter on CPU tensors.
"""

import math
import os
from dataclasses import dataclass

import torch

from engine.model.step_layout import AttentionBackend, StepLayout, padded_rows

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when this module loads.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
# Query rows of one prefill program: enough to feed the tensor cores, small enough to
# keep a fp32 accumulator of [rows, head_dim] in registers at head_dim 128.
_PREFILL_ROWS = 64
_KV_TILE = 64  # keys per loop iteration
_MIN_DOT = 16  # tl.dot needs at least 16 along each dimension on NVIDIA tensor cores
_NO_WINDOW = 1 << 30  # the window the kernels take for "the whole context"


if triton is not None:

    # K and V ([TILE, HEAD_DIM]) of one KV head at a request's positions ``pos``, found
    # through its block table; rows not ``valid`` load as zeros.
    @triton.jit
    def _load_kv_tile(
        k_cache_ptr,
        v_cache_ptr,
        table,
        pos,
        valid,
        kv_head,
        d,
        stride_cb,
        stride_ct,
        stride_ch,
        BLOCK_SIZE: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ):
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv = (
            block[:, None] * stride_cb
            + (pos % BLOCK_SIZE)[:, None] * stride_ct
            + kv_head * stride_ch
            + d[None, :]
        )
        k = tl.load(k_cache_ptr + kv, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        v = tl.load(v_cache_ptr + kv, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        return k, v

    # One K/V tile folded into the query rows' running max logits (m_i, base 2), exp sums
    # (l_i) and unnormalised output (acc); ``keep`` ([rows, TILE]) masks the keys each
    # row may attend to. A row that has kept no key yet (a sliding window starts past
    # this tile) stays at -inf, 0, 0.
    @triton.jit
    def _online_softmax_step(q, k, v, keep, m_i, l_i, acc, scale_log2, DOT_DTYPE: tl.constexpr):
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_ct,
        stride_ch,
        NUM_KV_HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        mask = h < NUM_KV_HEADS
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        block_tables_ptr,
        context_lens_ptr,
        scale_log2,
        window,
        num_heads,
        max_partitions,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_ct,
        stride_ch,
        stride_bt,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        PARTITION_SIZE: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        ctx_len = tl.load(context_lens_ptr + seq)
        start = part * PARTITION_SIZE
        if start >= ctx_len:
            return
        end = tl.minimum(start + PARTITION_SIZE, ctx_len)
        g = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + g
        head_mask = g < GROUP
        d = tl.arange(0, HEAD_DIM)
        first_key = tl.maximum(ctx_len - window, 0)  # the window's first key (0 without one)
        if SPLIT:  # (unsplit, the one partition holds the last key)
            if end <= first_key:  # a partition wholly before the window adds nothing to the reduce
                row = (seq * num_heads + heads) * max_partitions + part
                tl.store(part_max_ptr + row, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=head_mask)
                tl.store(part_sum_ptr + row, tl.zeros([GROUP_PAD], tl.float32), mask=head_mask)
                tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                         tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32), mask=head_mask[:, None])
                return
        start = tl.maximum(start, first_key)
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=head_mask[:, None],
            other=0.0,
        )
        q = q.to(DOT_DTYPE)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        table = block_tables_ptr + seq * stride_bt
        for tile in range(start, end, TILE):
            pos = tile + tl.arange(0, TILE)
            valid = pos < end
            k, v = _load_kv_tile(
                k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, d,
                stride_cb, stride_ct, stride_ch, BLOCK_SIZE, DOT_DTYPE,
            )  # fmt: skip
            m_i, l_i, acc = _online_softmax_step(
                q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, DOT_DTYPE
            )
        if SPLIT:
            row = (seq * num_heads + heads) * max_partitions + part
            tl.store(part_max_ptr + row, m_i, mask=head_mask)
            tl.store(part_sum_ptr + row, l_i, mask=head_mask)
            tl.store(
                part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                acc / l_i[:, None],
                mask=head_mask[:, None],
            )
        else:
            out = acc / l_i[:, None]
            dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])

    @triton.jit
    def _decode_reduce_kernel(
        out_ptr,
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        context_lens_ptr,
        num_heads,
        max_partitions,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        PARTITION_SIZE: tl.constexpr,
        PARTITIONS_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        num_parts = tl.cdiv(tl.load(context_lens_ptr + seq), PARTITION_SIZE)
        row = (seq * num_heads + head) * max_partitions
        p = tl.arange(0, PARTITIONS_PAD)
        live = p < num_parts
        m = tl.load(part_max_ptr + row + p, mask=live, other=float("-inf"))
        m_max = tl.max(m, 0)
        weights = tl.load(part_sum_ptr + row + p, mask=live, other=0.0) * tl.exp2(m - m_max)
        total = tl.sum(weights, 0)
        d = tl.arange(0, HEAD_DIM)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for i in range(0, num_parts):
            w = tl.load(part_sum_ptr + row + i) * tl.exp2(tl.load(part_max_ptr + row + i) - m_max)
            acc += w * tl.load(part_out_ptr + (row + i) * HEAD_DIM + d)
        dst = out_ptr + seq * stride_ot + head * stride_oh + d
        tl.store(dst, (acc / total).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_tables_ptr,
        query_start_ptr,
        context_start_ptr,
        scale_log2,
        window,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_ct,
        stride_ch,
        stride_bt,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        TILE: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        first = tl.program_id(1) * BLOCK_Q
        kv_head = tl.program_id(2)
        row0 = tl.load(query_start_ptr + seq)
        n = tl.load(query_start_ptr + seq + 1) - row0
        if first >= n:
            return
        ctx0 = tl.load(context_start_ptr + seq)
        # Row r of the tile is query token first + r // GROUP_PAD, head r % GROUP_PAD of the group.
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        tok = first + r // GROUP_PAD
        g = r % GROUP_PAD
        heads = kv_head * GROUP + g
        row_mask = (tok < n) & (g < GROUP)
        d = tl.arange(0, HEAD_DIM)
        q_rows = (row0 + tok).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        q = q.to(DOT_DTYPE)
        q_pos = ctx0 + tok
        kv_end = ctx0 + tl.minimum(n, first + BLOCK_Q)
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        table = block_tables_ptr + seq * stride_bt
        # The window (everything without one): the tile's first query sees keys from
        # first_key on, the others from later ones.
        first_key = tl.maximum(ctx0 + first - window + 1, 0)
        for tile in range(first_key, kv_end, TILE):
            pos = tile + tl.arange(0, TILE)
            valid = pos < kv_end
            k, v = _load_kv_tile(
                k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, d,
                stride_cb, stride_ct, stride_ch, BLOCK_SIZE, DOT_DTYPE,
            )  # fmt: skip
            # Causal, within the window; keys past kv_end are past every row's position too.
            causal = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _online_softmax_step(
                q, k, v, causal, m_i, l_i, acc, scale_log2, DOT_DTYPE
            )
        out = acc / l_i[:, None]
        dst = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@dataclass
class TritonMetadata:
    """One step's batch for the kernels. Host ints size the launch grids without a sync."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each row's new K/V
    num_decodes: int  # rows [0, num_decodes) are decode tokens, one per request
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] int32, the new token included
    max_decode_len: int
    num_prefills: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32, padded with 0
    prefill_query_start: torch.Tensor  # [num_prefills + 1] int32: the chunks' rows
    prefill_context_start: torch.Tensor  # [num_prefills] int32: tokens cached before each chunk
    max_chunk_len: int
    # Split-K partials, made by the first layer's decode and reused by the rest (one
    # stream runs the layers in order, so a layer's reduce has read them before the
    # next layer's decode writes).
    split_buffers: "SplitBuffers | None" = None


@dataclass(frozen=True)
class SplitBuffers:
    """Partial outputs, max logits and exp sums of the decode partitions ([B, Hq, P(, D)])."""

    out: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, partitions: int, head_dim: int, device) -> "SplitBuffers":
        shape = (batch, heads, partitions)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(*shape, head_dim, **f32), torch.empty(shape, **f32), torch.empty(shape, **f32))

    def fits(self, batch: int, heads: int, partitions: int, head_dim: int, device) -> bool:
        return self.out.shape == (batch, heads, partitions, head_dim) and self.out.device == torch.device(device)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (tl.arange lengths must be powers of two)."""
    return 1 << max(0, n - 1).bit_length()


def _padded_tables(
    tables: list[list[int]], lens: list[int], block_size: int, device: torch.device
) -> torch.Tensor:
    """[len(tables), max blocks] int32 block ids, cut to each context and padded with 0."""
    rows = padded_rows(tables, lens, block_size)
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(rows), len(rows[0]) if rows else 0)


def _dot_dtype(dtype: torch.dtype) -> "tl.dtype":
    # The interpreter multiplies bfloat16 blocks as their raw uint16 bits, so there
    # bf16 operands are widened to fp32 first; compiled kernels keep bf16 for the MMA.
    if INTERPRETED and dtype == torch.bfloat16:
        return tl.float32
    return getattr(tl, str(dtype).removeprefix("torch."))


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Scatter new K/V rows ([T, Hkv, D]) into one layer's cache ([N, block, Hkv, D]) by slot."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_pow2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    partition_size: int,
    buffers: SplitBuffers | None = None,
    window: int = 0,
) -> SplitBuffers | None:
    """One query row per request (q, out: [B, Hq, D]); split-K once a context passes a
    partition; ``window`` > 0: over each row's ``window`` latest keys only.

    Returns the split buffers it used (``buffers`` when they fit), for the next layer.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    partitions = -(-max_context_len // partition_size)
    split = partitions > 1
    if split:
        shape = (batch, num_heads, partitions, head_dim, q.device)
        if buffers is None or not buffers.fits(*shape):
            buffers = SplitBuffers.empty(*shape)
        part_out, part_max, part_sum = buffers.out, buffers.max, buffers.sum
    else:
        part_out = part_max = part_sum = out  # unused without a split
    _decode_kernel[(batch, num_kv_heads, partitions)](
        q, k_cache, v_cache, out, part_out, part_max, part_sum, block_tables, context_lens,
        scale * math.log2(math.e), window or _NO_WINDOW, num_heads, partitions,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(_MIN_DOT, _pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=min(_KV_TILE, partition_size), PARTITION_SIZE=partition_size,
        SPLIT=split, DOT_DTYPE=_dot_dtype(q.dtype),
    )  # fmt: skip
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            out, part_out, part_max, part_sum, context_lens, num_heads, partitions,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, PARTITION_SIZE=partition_size, PARTITIONS_PAD=_pow2(partitions),
        )  # fmt: skip
    return buffers if split else None


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_start: torch.Tensor,
    max_chunk_len: int,
    scale: float,
    window: int = 0,
) -> None:
    """Chunks of query rows (rows query_start[i]..query_start[i+1] of q, out: [T, Hq, D]);
    ``window`` > 0: each row over its ``window`` latest keys only."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    block_q = max(1, _PREFILL_ROWS // group_pad)
    grid = (context_start.numel(), -(-max_chunk_len // block_q), num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_start,
        scale * math.log2(math.e), window or _NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, TILE=_KV_TILE, DOT_DTYPE=_dot_dtype(q.dtype),
    )  # fmt: skip


class TritonAttention(AttentionBackend):
    """The Triton backend: paged decode (split-K) and prefill kernels, no K/V gathering."""

    name = "triton"
    write_kv = staticmethod(write_kv)

    def __init__(
        self, block_size: int, device: torch.device | str, head_dim: int, partition_size: int = 512
    ) -> None:
        if triton is None:
            raise RuntimeError(
                "attention_backend='triton' needs the triton package: "
                "pip install 'tandem-serve[gpu]'"
            )
        device = torch.device(device)
        if device.type != "cuda" and not INTERPRETED:
            raise RuntimeError(
                f"attention_backend='triton' needs a CUDA device, got {device}; set "
                "TRITON_INTERPRET=1 before engine.model.triton_attention is imported to run its "
                "kernels in Triton's interpreter on CPU"
            )
        if head_dim < _MIN_DOT or head_dim & (head_dim - 1):
            raise ValueError(
                f"the triton backend needs a power-of-two head_dim >= {_MIN_DOT}, got {head_dim}"
            )
        if partition_size < _MIN_DOT or partition_size & (partition_size - 1):
            raise ValueError(
                f"partition_size must be a power of two >= {_MIN_DOT}, got {partition_size}"
            )
        self.block_size = block_size
        self.device = device
        self.partition_size = partition_size

    def build_metadata(self, layout: StepLayout) -> TritonMetadata:
        dev, bs = self.device, self.block_size
        chunks = layout.chunks
        starts = [chunks[0].row0 if chunks else 0] + [c.row0 + c.num_tokens for c in chunks]
        return TritonMetadata(
            slot_mapping=torch.tensor(layout.slots, dtype=torch.long, device=dev),
            num_decodes=len(layout.decode_context_lens),
            decode_block_tables=torch.from_numpy(layout.decode_block_table).to(dev, torch.int32),
            decode_context_lens=torch.tensor(
                layout.decode_context_lens, dtype=torch.int32, device=dev
            ),
            max_decode_len=max(layout.decode_context_lens, default=0),
            num_prefills=len(chunks),
            prefill_block_tables=_padded_tables(
                [c.block_ids for c in chunks], [c.start + c.num_tokens for c in chunks], bs, dev
            ),
            prefill_query_start=torch.tensor(starts, dtype=torch.int32, device=dev),
            prefill_context_start=torch.tensor(
                [c.start for c in chunks], dtype=torch.int32, device=dev
            ),
            max_chunk_len=max((c.num_tokens for c in chunks), default=0),
        )

    def attend(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float, out, window: int = 0) -> None:
        if meta.num_decodes:
            n = meta.num_decodes
            meta.split_buffers = decode_attention(
                q[:n], k_cache, v_cache, out[:n], meta.decode_block_tables,
                meta.decode_context_lens, meta.max_decode_len, scale, self.partition_size,
                meta.split_buffers, window,
            )  # fmt: skip
        if meta.num_prefills:
            prefill_attention(
                q, k_cache, v_cache, out, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_context_start, meta.max_chunk_len, scale, window,
            )  # fmt: skip
