"""Sliding-window attention: every backend, on a step of decode rows and prefill chunks
(fresh, mid-context, mid-block), against attention written out here from the whole
keys and an explicit window mask; and the per-layer windows a config gives.

The Triton kernels run in Triton's interpreter without CUDA (this module sets
TRITON_INTERPRET before anything imports triton, as test_triton_attention does).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model.attention import TorchAttention  # noqa: E402
from engine.model.model_config import ModelConfig  # noqa: E402
from tests.helpers import random_step_layout  # noqa: E402

CPU = torch.device("cpu")
NUM_BLOCKS = 96
BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 2, 32
DECODES = [1, 5, 16, 17, 40, 90, 131]  # shorter than, equal to and longer than the windows
CHUNKS = [(0, 37), (20, 30), (BLOCK + 3, 19), (64, 9)]


def _step(seed: int = 0, device=CPU):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    layout = random_step_layout(BLOCK, DECODES, CHUNKS, rng, NUM_BLOCKS)
    rows = len(layout.slots)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    cache = (randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM))
    q, k, v = randn(rows, HEADS, HEAD_DIM), randn(rows, KV_HEADS, HEAD_DIM), randn(rows, KV_HEADS, HEAD_DIM)
    return layout, cache, q, k, v


def _written_out(layout, cache, q, k, v, window: int) -> torch.Tensor:
    """Each query row against its request's whole keys (read back through the block
    table after the step's write), masked to causal within ``window`` (0: none)."""
    from engine.model.attention import write_kv

    k_cache, v_cache = (c.clone() for c in cache)
    write_kv(k_cache, v_cache, k, v, torch.tensor(layout.slots, device=q.device))
    requests = [(i, 1, ctx - 1, table) for i, (ctx, table) in
                enumerate(zip(layout.decode_context_lens, layout.decode_block_table.tolist()))]
    requests += [(c.row0, c.num_tokens, c.start, c.block_ids) for c in layout.chunks]
    out = torch.empty_like(q)
    for row0, n, first_pos, table in requests:
        ctx = first_pos + n
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)], device=q.device)
        keys = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(HEADS // KV_HEADS, 1)
        values = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(HEADS // KV_HEADS, 1)
        q_pos = torch.arange(first_pos, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        keep = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = torch.einsum("qhd,khd->hqk", q[row0 : row0 + n].float(), keys.float()) * HEAD_DIM**-0.5
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        out[row0 : row0 + n] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
    return out


def _backend(name: str, device):
    if name == "torch":
        return TorchAttention(BLOCK, device)
    if name == "cpu":
        from engine.model.cpu_attention import CpuAttention, kernel_available

        if not kernel_available():
            pytest.skip("the CPU attention kernel does not build here")
        return CpuAttention(BLOCK, device)
    pytest.importorskip("triton", reason="triton is not installed (it comes with the test and gpu extras)")
    from engine.model.triton_attention import TritonAttention

    return TritonAttention(BLOCK, device, HEAD_DIM, partition_size=32)


@pytest.mark.parametrize("window", [0, 1, 7, 16, 50])
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_every_backend_attends_within_the_window(name, window):
    device = torch.device("cuda") if name == "triton" and ON_GPU else CPU
    layout, cache, q, k, v = _step(device=device)
    want = _written_out(layout, cache, q, k, v, window)
    backend = _backend(name, device)
    k_cache, v_cache = (c.clone() for c in cache)
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout), HEAD_DIM**-0.5, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if window:  # the window must have changed something, or the test shows nothing
        full = _written_out(layout, cache, q, k, v, 0)
        assert not torch.allclose(got, full, atol=1e-3), f"a window of {window} should change the outputs"


def test_the_layers_of_one_step_each_take_their_own_window():
    """Masks made for one window are not handed to a layer with another (they are kept
    per window in the step's metadata)."""
    layout, cache, q, k, v = _step(seed=1)
    backend = TorchAttention(BLOCK, CPU)
    meta = backend.build_metadata(layout)
    for window in (7, 0, 50, 7):
        got = backend.forward(q, k, v, *(c.clone() for c in cache), meta, HEAD_DIM**-0.5, window)
        torch.testing.assert_close(got, _written_out(layout, cache, q, k, v, window), atol=2e-5, rtol=2e-5)


BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=100, num_hidden_layers=4)


@pytest.mark.parametrize(
    "cfg,windows",
    [
        (dict(architectures=["MistralForCausalLM"], sliding_window=64), (64, 64, 64, 64)),
        (dict(architectures=["MistralForCausalLM"], sliding_window=None), (0, 0, 0, 0)),
        (dict(architectures=["Phi3ForCausalLM"], sliding_window=32), (32, 32, 32, 32)),
        (dict(architectures=["Qwen2ForCausalLM"], sliding_window=64), (0, 0, 0, 0)),  # use_sliding_window unset
        (dict(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=True, max_window_layers=2),
         (0, 0, 64, 64)),
        (dict(architectures=["Qwen2ForCausalLM"], sliding_window=64,
              layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"]),
         (0, 64, 0, 64)),
    ],
)
def test_each_layer_gets_the_window_transformers_gives_it(cfg, windows):
    config = ModelConfig.from_dict({**BASE, **cfg})
    assert config.layer_windows == windows
    assert config.max_model_len == 2048, "a window no longer caps the context"
