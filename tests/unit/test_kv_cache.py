"""The KV cache's block copies: gather, scatter and swap move whole blocks intact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.kv_cache import KVCache
from engine.model.model_config import ModelConfig

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8


def _cache(num_blocks: int = 8, num_cpu_blocks: int = 4) -> KVCache:
    fields = {f.name: None for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**{**fields, "num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM})
    cache = KVCache(config, num_blocks, BLOCK, torch.float32, "cpu", num_cpu_blocks)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    return cache


def test_gather_returns_the_blocks_in_the_order_asked_and_scatter_writes_them_back():
    cache = _cache()
    k, v = cache.gather([5, 2])
    assert k.shape == (LAYERS, 2, BLOCK, HEADS, DIM)
    assert torch.equal(k[:, 0], cache.k[:, 5]) and torch.equal(v[:, 1], cache.v[:, 2])
    cache.scatter([1, 3], k.to(torch.float16), v)
    assert torch.allclose(cache.k[:, 1], k[:, 0], atol=1e-2), "scatter converts to the cache's dtype"
    assert torch.equal(cache.v[:, 3], v[:, 1])


def test_scatter_refuses_kv_that_does_not_fit_the_blocks():
    cache = _cache()
    k, v = cache.gather([1, 2, 3])
    with pytest.raises(ValueError, match="does not fit 2 blocks"):
        cache.scatter([4, 5], k, v)
    with pytest.raises(ValueError, match="does not fit"):
        cache.scatter([4, 5, 6], k[..., :4], v[..., :4])


def test_a_swapped_out_block_comes_back_unchanged_into_another_block():
    cache = _cache()
    before = (cache.k[:, 6].clone(), cache.v[:, 6].clone())
    cache.swap_out([(6, 1)])
    cache.k[:, 6].zero_()
    cache.swap_in([(1, 2)])
    assert torch.equal(cache.k[:, 2], before[0]) and torch.equal(cache.v[:, 2], before[1])
