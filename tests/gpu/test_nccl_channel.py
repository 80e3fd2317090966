"""The collective backend's pair channels between paged caches on GPUs, two backends in
one process: NCCL between caches on two GPUs (skips on one, saying why), and gloo between
caches that share one GPU (NCCL takes no two ranks of a communicator on one device), each
message staged through host memory.

The channels' rules run on CPU in ``tests/unit/test_nccl_channel.py`` (a fake NCCL) and
``tests/unit/test_collective_paged.py``; here the real calls move device memory.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.gpu.device import ON_GPU

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (tests/unit covers the channels on CPU)")
needs_two_gpus = pytest.mark.skipif(
    not ON_GPU or torch.cuda.device_count() < 2 or importlib.util.find_spec("cupy") is None,
    reason=f"an NCCL pair needs two GPUs (NCCL takes no two ranks of a communicator on one device) and cupy; "
    f"this machine has {torch.cuda.device_count()} GPU(s)",
)


def _transfer(devices: tuple[str, str]) -> tuple[bool, list[bool]]:
    """A paged transfer of 3 blocks from a cache on ``devices[0]`` to one on ``devices[1]``:
    whether they arrived, and which of the receiver's channels move device memory."""
    from engine.wire.messages import KVLayout
    from kv_transfer.base import TransferMeta
    from kv_transfer.collective import CollectiveBackend
    from kv_transfer.peer import checksum

    layout = KVLayout(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    sender, receiver = (CollectiveBackend(op_timeout_s=30, channel="nccl", device=d) for d in devices)
    src = [torch.randn(layout.packed_shape(16), device=devices[0]).to(torch.bfloat16) for _ in range(2)]
    dst = [torch.zeros(layout.packed_shape(16), dtype=torch.bfloat16, device=devices[1]) for _ in range(2)]
    sender.attach_cache(*src)
    receiver.attach_cache(*dst)
    try:
        meta = TransferMeta("t", "t", layout, 3, 48, dst_endpoint=receiver.endpoint, deadline=time.time() + 60,
                            dst_blocks=(5, 9, 10))
        payload = sender.prepare_blocks(meta, [1, 2, 3])
        with ThreadPoolExecutor(1) as pool:
            pull = pool.submit(receiver.pull_blocks, meta, payload, [5, 9, 10])
            sender.push(meta, None, None, payload)
            pull.result(timeout=60)
        torch.cuda.synchronize()
        got = checksum(*(c[:, [5, 9, 10]].cpu() for c in dst))
        arrived = got == checksum(*(c[:, [1, 2, 3]].cpu() for c in src))
        return arrived, [c.on_device for c in receiver._in.channels.values()]
    finally:
        sender.close()
        receiver.close()


@needs_gpu
def test_caches_sharing_a_gpu_move_blocks_over_gloo_through_host_memory():
    arrived, on_device = _transfer(("cuda:0", "cuda:0"))
    assert arrived, "the blocks differ after the transfer"
    assert on_device == [False], "one device: the pair's channel is gloo"


@needs_two_gpus
def test_caches_on_two_gpus_move_blocks_over_nccl():
    arrived, on_device = _transfer(("cuda:0", "cuda:1"))
    assert arrived, "the blocks differ after the transfer"
    assert on_device == [True], "two devices: the pair's channel is NCCL"
