"""Mixture-of-experts experts in Triton: two grouped GEMMs over the step's (token, expert)
pairs sorted by expert, the GPU path of ``engine.model.moe.SparseMoE``.

The way through, for T tokens each routed to K experts (vLLM's fused_moe in outline)::

    sort the T*K pairs by expert; pad each expert's run to a multiple of BLOCK_M rows
    (``align``): every tile of BLOCK_M rows then belongs to one expert
    GEMM 1: rows x[token] @ gate_up[e]^T      -> [T*K, 2I]   (one program per tile and N block)
    SwiGLU in torch                          -> [T*K, I]
    GEMM 2: rows h[pair] @ down[e]^T * weight -> [T*K, H]
    sum each token's K rows                  -> [T, H]

Each program loads its tile's expert id and row indices, so the expert weights are read
once per tile, not once per token, and no per-expert launch or host loop is needed: two
launches per layer whatever the routing. Padding rows (index T*K) load zeros and store
nothing. Triton is imported guarded, as in ``engine.model.triton_attention``; with
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests' way).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # tl.dot needs 16 or more along each dimension


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, weights_ptr,
        num_pairs, n, k,
        stride_am, stride_we, stride_wn, stride_om,
        TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, SCALE: tl.constexpr, WIDEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """out[pair, n-block] = A[row] @ W[expert]^T (times the pair's weight with SCALE);
        A's row is the pair's token (A_BY_TOKEN) or the pair itself."""
        tile, pid_n = tl.program_id(0), tl.program_id(1)
        pairs = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        a_rows = (pairs // TOP_K if A_BY_TOKEN else pairs).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                        mask=valid[:, None] & (ks[None, :] < k), other=0.0)
            w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                        mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)
            if WIDEN:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision="ieee")
        if SCALE:
            acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        dst = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n))


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs (``experts``: [T, K], pair p = t * K + k) sorted by
    expert, each expert's run padded to a multiple of ``block_m`` with the index T*K:
    (pair indices [tiles * block_m], the expert of each tile [tiles])."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # each expert's first padded row
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    rows = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.int32, device=flat.device)
    rows[starts[flat[order]] + rank] = order.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return rows, tile_expert.to(torch.int32)


def _gemm(a, w, rows, tile_expert, num_pairs, top_k, weights=None, by_token=True) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (tile_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, out, rows, tile_expert, weights if weights is not None else out,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_BY_TOKEN=by_token, SCALE=weights is not None,
        # The interpreter multiplies bfloat16 blocks as their raw bits: widen them there.
        WIDEN=INTERPRETED and a.dtype == torch.bfloat16,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor, act) -> torch.Tensor:
    """The weighted sum of each token's experts (x: [T, H]; gate_up: [E, 2I, H]; down:
    [E, H, I]; weights, experts: [T, K]) in two grouped GEMMs."""
    if triton is None:
        raise RuntimeError("the Triton MoE path needs the triton package: pip install 'tandem-serve[gpu]'")
    num_tokens, top_k = experts.shape
    num_pairs, inter = num_tokens * top_k, down.shape[2]
    rows, tile_expert = align(experts, gate_up.shape[0])
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    h = _gemm(x, gate_up, rows, tile_expert, num_pairs, top_k)
    h = act(h[:, :inter]) * h[:, inter:]
    y = _gemm(h.contiguous(), down, rows, tile_expert, num_pairs, top_k,
              weights=weights.reshape(-1).float().contiguous(), by_token=False)
    return y.view(num_tokens, top_k, -1).sum(1)
