"""A share of the sender's KV heads read into some heads of this side's blocks: what a
tensor-parallel rank reads from a worker of another size (``kv_transfer.sharded`` plans
which heads of which rank; ``NixlBackend.pull_heads`` in ``kv_transfer.nixl`` picks the
way and runs the read).

Two ways, for when the shares differ (equal shares read whole blocks, ``pull_blocks``):

- Staged (``pull_staged``): this side needs every head of the sender's blocks, in host
  memory. They are read a stretch of blocks a descriptor into a registered staging
  buffer (``kv_transfer.nixl_agent.RegisteredStaging``), then copied into this side's
  heads: a descriptor a token would cost more than the copy.
- A descriptor a token (``head_xfer_descs``): a head's row of a token is the longest
  stretch alike on both sides (``[block, token, heads, dim]``), so one descriptor a
  token, layer and K or V, straight into the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kv_transfer.base import TransferError, TransferMeta, contiguous_runs
from kv_transfer.nixl_agent import PagedPayload, RegisteredCache, RegisteredStaging, block_descs


def head_descs(base: tuple[int, int], num_blocks: int, layers: int, block_size: int, heads: int, head_bytes: int,
               device: int, block_ids: Sequence[int], head_range: tuple[int, int]) -> np.ndarray:
    """Nx3 (address, length, device) rows for heads ``head_range`` of every token of
    ``block_ids`` in every layer of K then V, in (K/V, layer, block, token) order. A token of
    block ``b`` in layer ``l`` starts at ``((l * num_blocks + b) * block_size + t) * heads *
    head_bytes`` past the base; its heads lie one after another."""
    token_bytes = heads * head_bytes
    layer = np.arange(layers, dtype=np.int64)[:, None, None]
    block = np.asarray(block_ids, dtype=np.int64)[None, :, None]
    token = np.arange(block_size, dtype=np.int64)[None, None, :]
    starts = ((layer * num_blocks + block) * block_size + token) * token_bytes + head_range[0] * head_bytes
    length = (head_range[1] - head_range[0]) * head_bytes
    rows = [np.stack([addr + starts, np.full_like(starts, length), np.full_like(starts, device)], axis=-1)
            for addr in base]
    return np.concatenate([r.reshape(-1, 3) for r in rows])


def check_heads(meta: TransferMeta, payload: PagedPayload, src: tuple[int, int], dst: tuple[int, int],
                heads: int) -> int:
    """How many heads go: ``src`` lies within the sender's heads and ``dst``, as many, within
    this cache's ``heads``; TransferError("layout") otherwise, before any read."""
    n = src[1] - src[0]
    if not (0 <= src[0] < src[1] <= payload.heads and 0 <= dst[0] and dst[0] + n == dst[1] <= heads):
        raise TransferError("layout", f"transfer {meta.transfer_id}: heads {src} of the sender's "
                                      f"{payload.heads} do not fit heads {dst} of this cache's {heads}")
    return n


def head_xfer_descs(agent, payload: PagedPayload, block_ids: list[int], src: tuple[int, int],
                    dst: tuple[int, int], cache: RegisteredCache) -> tuple[object, object, int]:
    """(local, remote, bytes) of a read of heads ``src`` of the sender's blocks into heads
    ``dst`` of ``block_ids``: a descriptor a token, layer and K or V."""
    heads, n = cache.k.shape[3], src[1] - src[0]
    layers, block_size, head_bytes = cache.k.shape[0], cache.k.shape[2], cache.k[0, 0, 0, 0].nbytes
    remote = agent.get_xfer_descs(head_descs(
        payload.base, payload.num_blocks, layers, block_size, payload.heads, head_bytes, payload.device,
        payload.block_ids, src), cache.mem_type)
    local = agent.get_xfer_descs(head_descs(
        (cache.k.data_ptr(), cache.v.data_ptr()), cache.k.shape[1], layers, block_size, heads, head_bytes,
        cache.device, block_ids, dst), cache.mem_type)
    nbytes = 2 * len(block_ids) * layers * block_size * n * head_bytes
    return local, remote, nbytes


def pull_staged(agent, staging: RegisteredStaging, read: Callable[..., None], meta: TransferMeta,
                payload: PagedPayload, block_ids: list[int], dst: tuple[int, int], cache: RegisteredCache) -> None:
    """Every head of the sender's blocks, which this side needs all of, into a registered
    staging buffer a stretch of blocks a descriptor (as between equal sizes), then copied
    into heads ``dst`` of ``block_ids``: a descriptor a token would cost more than the copy.
    A read that cannot be cancelled keeps only the staging buffer out of use. ``read``
    (``agent, meta, payload, local, remote, nbytes, unfinished``) reads and counts."""
    layers, block_size, head_dim = cache.k.shape[0], cache.k.shape[2], cache.k.shape[4]
    block_bytes = block_size * payload.heads * head_dim * cache.k.element_size()
    src_runs, _ = contiguous_runs(list(payload.block_ids), list(range(len(block_ids))))
    remote_rows = block_descs(payload.base, payload.num_blocks, layers, block_bytes, payload.device, src_runs)
    nbytes = int(remote_rows[:, 1].sum())
    buffer = staging.take(nbytes)
    starts = buffer.data_ptr() + np.concatenate([[0], np.cumsum(remote_rows[:-1, 1])])
    local_rows = np.stack([starts, remote_rows[:, 1], np.zeros_like(starts)], axis=-1)
    try:  # a quarantined buffer is not given back
        read(agent, meta, payload, agent.get_xfer_descs(local_rows, "DRAM"),
             agent.get_xfer_descs(remote_rows, "DRAM"), nbytes, lambda: staging.quarantine(buffer))
        both = buffer.view(cache.k.dtype).view(2, layers, len(block_ids), block_size, payload.heads, head_dim)
        index = torch.as_tensor(block_ids, dtype=torch.long)
        cache.k[:, index, :, dst[0] : dst[1]] = both[0]
        cache.v[:, index, :, dst[0] : dst[1]] = both[1]
    finally:
        staging.give(buffer)
