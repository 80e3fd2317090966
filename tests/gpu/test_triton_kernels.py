"""The Triton kernels agree with the torch reference, at serving shapes on a GPU.

On CUDA: decode of 64 requests with contexts up to 4096 tokens (8 partitions of 512),
32 query heads over 4 KV heads (GQA 8), head_dim 128; prefill chunks of up to 2048
tokens, fresh, mid-block and block-aligned. On CPU (``tests/gpu/device.py``) the same
cases run in Triton's interpreter at small sizes: GQA 8 at head_dim 32, partitions of
64 tokens so that contexts of a few hundred still split. The reference runs in fp32 on
the same (rounded) inputs, so the tolerance covers only the kernel's own 16-bit rounding.

Decode rows are laid out shortest first, as the model runner lays them out.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import TorchAttention
from engine.step_layout import ChunkLayout, StepLayout
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


def _layout(
    decode_lens: list[int], chunks: list[tuple[int, int]], seed: int
) -> tuple[StepLayout, int]:
    """Requests on shuffled blocks; returns the layout and the number of blocks it needs."""
    need = sum(-(-n // BLOCK_SIZE) for n in decode_lens) + sum(
        -(-(s + n) // BLOCK_SIZE) for s, n in chunks
    )
    free = list(range(1, need + 1))
    random.Random(seed).shuffle(free)
    layout = StepLayout(slots=[], decode_block_ids=[], decode_context_lens=[], chunks=[])
    for ctx in sorted(decode_lens):
        table = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        layout.decode_block_ids.append(table)
        layout.decode_context_lens.append(ctx)
        layout.slots.append(table[(ctx - 1) // BLOCK_SIZE] * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE)
    row = len(decode_lens)
    for start, n in chunks:
        table = [free.pop() for _ in range(-(-(start + n) // BLOCK_SIZE))]
        layout.chunks.append(ChunkLayout(row, n, start, table))
        layout.slots.extend(
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)
        )
        row += n
    return layout, need + 1


def _compare(dtype: torch.dtype, decode_lens: list[int], chunks: list[tuple[int, int]]) -> None:
    from engine.triton_attention import TritonAttention

    layout, num_blocks = _layout(decode_lens, chunks, seed=0)
    rows = len(layout.slots)
    torch.manual_seed(0)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=DEVICE, dtype=dtype)
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    k = torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    v = torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    scale = HEAD_DIM**-0.5

    ref = TorchAttention(BLOCK_SIZE, torch.device(DEVICE))
    fp32 = [t.float() for t in (q, k, v, k_cache, v_cache)]
    want = ref.forward(*fp32, ref.build_metadata(layout), scale)
    backend = TritonAttention(BLOCK_SIZE, DEVICE, HEAD_DIM, PARTITION)
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout), scale)
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
