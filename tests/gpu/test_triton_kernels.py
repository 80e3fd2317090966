"""The Triton kernels agree with the torch reference, at serving shapes on a GPU.

On CUDA: decode of 64 requests with contexts up to 4096 tokens (8 partitions of 512),
32 query heads over 4 KV heads (GQA 8), head_dim 128; prefill chunks of up to 2048
tokens, fresh, mid-block and block-aligned. On CPU (``tests/gpu/device.py``) the same
cases run in Triton's interpreter at small sizes: GQA 8 at head_dim 32, partitions of
64 tokens so that contexts of a few hundred still split. The reference runs in fp32 on
the same (rounded) inputs, so the tolerance covers only the kernel's own 16-bit rounding.

Decode rows are laid out shortest first, as the model runner lays them out
(``bench.gpu.paged_layout``, which the GPU benchmark times the same kernels on).
"""

from __future__ import annotations

import random

import pytest
import torch

from bench.gpu import paged_layout, paged_tensors
from engine.model.attention import TorchAttention
from tests.gpu.device import DEVICE, ON_GPU, sync

pytest.importorskip("triton", reason="triton is not installed (it comes with the gpu extra)")

BLOCK_SIZE = 16
if ON_GPU:
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTITION = 32, 4, 128, 512
    MAX_CONTEXT, BATCH = 4096, 64
    PREFILL_CHUNKS = [(0, 2048), (1000, 1024), (2048, 512), (7, 3)]
    MIXED = ([1, 700, 4096, 513], [(0, 300), (4000, 96)])
else:
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTITION = 8, 1, 32, 64
    MAX_CONTEXT, BATCH = 300, 6
    PREFILL_CHUNKS = [(0, 130), (100, 70), (64, 32), (7, 3)]
    MIXED = ([1, 90, 300, 65], [(0, 40), (250, 24)])
TOLERANCE = {torch.float16: dict(atol=2e-3, rtol=1e-2), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}


def _compare(dtype: torch.dtype, decode_lens: list[int], chunks: list[tuple[int, int]], window: int = 0) -> None:
    from engine.model.triton_attention import TritonAttention

    layout, num_blocks = paged_layout(decode_lens, chunks, BLOCK_SIZE, seed=0)
    heads = dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE)
    (k_cache, v_cache), q, (k, v) = paged_tensors(layout, num_blocks, heads, dtype, DEVICE)
    scale = HEAD_DIM**-0.5

    ref = TorchAttention(BLOCK_SIZE, torch.device(DEVICE))
    fp32 = [t.float() for t in (q, k, v, k_cache, v_cache)]
    want = ref.forward(*fp32, ref.build_metadata(layout), scale, window)
    backend = TritonAttention(BLOCK_SIZE, DEVICE, HEAD_DIM, PARTITION)
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout), scale, window)
    sync()
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_decode_batch_of_long_split_contexts_with_gqa_8_matches_torch(dtype):
    rng = random.Random(1)
    lens = [MAX_CONTEXT] + [rng.randint(1, MAX_CONTEXT) for _ in range(BATCH - 1)]
    _compare(dtype, decode_lens=lens, chunks=[])


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_prefill_chunks_fresh_mid_block_and_aligned_match_torch(dtype):
    _compare(dtype, decode_lens=[], chunks=PREFILL_CHUNKS)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_mixed_decode_and_prefill_batch_matches_torch(dtype):
    _compare(dtype, decode_lens=MIXED[0], chunks=MIXED[1])


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_sliding_window_decode_and_prefill_match_torch(dtype):
    """A window shorter than most contexts (Mistral's, Gemma 3's local layers): decode
    partitions wholly before it are skipped, prefill tiles start at it."""
    decode_lens, chunks = MIXED
    _compare(dtype, decode_lens=decode_lens, chunks=chunks, window=PARTITION + PARTITION // 2)
    _compare(dtype, decode_lens=decode_lens, chunks=chunks, window=17)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_fused_moe_experts_match_torch(dtype):
    """The grouped-GEMM experts (``engine.model.triton_moe``) against the float32 torch experts
    on the CPU, at a Qwen3-MoE-like shape on a GPU (128 experts, top-8, 256 tokens)."""
    from torch.nn import functional as F

    from engine.model.model_config import MoEConfig
    from engine.model.moe import SparseMoE, route
    from engine.model.triton_moe import fused_experts

    hidden, inter, experts, top_k, tokens = (1024, 256, 128, 8, 256) if ON_GPU else (64, 32, 8, 2, 20)
    torch.manual_seed(0)
    moe = SparseMoE(hidden, MoEConfig(experts, top_k, inter, True, (0,)), F.silu)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, hidden**-0.5)
    x = torch.randn(tokens, hidden)
    with torch.inference_mode():
        want = moe(x)  # the CPU's grouped torch experts, float32
        weights, chosen = route(moe.gate(x), top_k, True)
        w16 = [t.to(DEVICE, dtype) for t in (x, moe.experts_gate_up, moe.experts_down)]
        got = fused_experts(*w16, weights.to(DEVICE), chosen.to(DEVICE), F.silu)
    sync()
    torch.testing.assert_close(got.float().cpu(), want, atol=5e-2, rtol=5e-2)
