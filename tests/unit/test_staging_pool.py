"""The collective backend's reusable receive buffers."""

import torch

from kv_transfer.collective_channels import StagingPool


def test_buffers_are_reused_smallest_fit_first():
    pool = StagingPool(max_buffers=4)
    big = pool.take((4, 1024), torch.float32, "cpu")
    small = pool.take((1, 1024), torch.float32, "cpu")
    big_ptr, small_ptr = big.data_ptr(), small.data_ptr()
    pool.give(big)
    pool.give(small)
    again = pool.take((1, 512), torch.float32, "cpu")
    assert again.data_ptr() == small_ptr, "the smallest buffer that fits should be reused"
    assert pool.take((3, 1024), torch.float32, "cpu").data_ptr() == big_ptr
    assert again.shape == (1, 512) and again.dtype == torch.float32


def test_pool_keeps_at_most_max_buffers_dropping_the_smallest():
    pool = StagingPool(max_buffers=2)
    tensors = [pool.take((n, 256), torch.bfloat16, "cpu") for n in (1, 2, 3)]
    for t in tensors:
        pool.give(t)
    assert sorted(b.numel() for b in pool._free) == [2 * 256 * 2, 3 * 256 * 2]
