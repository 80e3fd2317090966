"""Per-block checksums of KV, so that a corrupt or misdirected block fails its transfer.

The sender sums each block it offers (``TransferMeta.checksums``, one per block, in the
transfer's order) and the receiver sums the blocks it read into; a difference is a
``TransferError("checksum")``, never KV served. A setting (``TransferConfig.checksums``),
on by default: each side reads every byte once more, which costs little beside the read
and the prefill (docs/BENCHMARKS.md), and a bug that hands a reader the wrong blocks then
fails loudly instead of streaming another prompt's continuation.

The sum is a position-weighted word checksum, not a cryptographic hash: the block's
bytes as int32 words, summed (wrapping) over each token's row of each KV head, and those
row sums combined with odd weights per (K or V, layer, token, head). It runs at memory
speed (one vectorised pass, no copy of the blocks) and catches what a transfer can get
wrong: another block's or another request's KV, a missing or changed word, layers,
tokens or heads of a block swapped. The weights are indexed by the model's KV head, so
a block's sum is the sum (mod 2**32) of its parts' sums over any split of the heads:
ranks of a tensor-parallel worker each sum the heads they hold (``heads``), and a sender
and a receiver split differently still compare one number a block. Peers inside the
cluster are trusted (SECURITY.md); nothing here resists one that forges KV.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kv_transfer.base import TransferError, TransferMeta, contiguous_runs

_MASK = (1 << 32) - 1


@functools.lru_cache(maxsize=16)
def _weights(num_layers: int, block_size: int, num_heads: int, device: torch.device) -> torch.Tensor:
    """Odd int64 weights per (K or V, layer, token, KV head of the model), the same on every
    process: ``[2, layers, 1, block_size, num_heads]``."""
    g = torch.Generator().manual_seed(0x7A4D)
    w = torch.randint(1, 1 << 31, (2, num_layers, block_size, num_heads), generator=g, dtype=torch.int64)
    return (w | 1)[:, :, None].to(device)


def block_checksums(
    k: torch.Tensor, v: torch.Tensor, block_ids: list[int], heads: tuple[int, int] | None = None,
) -> tuple[int, ...]:
    """One checksum per block of ``block_ids`` (in that order) of a ``[layers, blocks,
    block_size, kv_heads, head_dim]`` K and V (a paged cache, or packed KV with ``range``
    ids). ``heads``: (first, total) when these tensors hold the model's KV heads ``first``
    to ``first + kv_heads`` of ``total`` (a tensor-parallel rank's share; the sums of every
    share add up to the whole block's, mod 2**32); None: all of them."""
    if not len(block_ids):
        return ()
    num_layers, block_size, num_heads = k.shape[0], k.shape[2], k.shape[3]
    first, total = heads if heads is not None else (0, num_heads)
    if not 0 <= first <= total - num_heads:
        raise ValueError(f"heads {first}..{first + num_heads} are not within the model's {total}")
    runs, _ = contiguous_runs(block_ids, range(len(block_ids)))
    # On a GPU a call per run of scattered blocks costs a launch each (18.9 GB/s over
    # 256 blocks on an H200, against 717 in one run); gathering them first costs a copy
    # at HBM speed. On a CPU the copy costs more than the calls.
    if len(runs) > 1 and k.device.type != "cpu":
        sides = [_gathered_sums(cache, block_ids) for cache in (k, v)]
    else:
        sides = [_sums_by_runs(cache, runs) for cache in (k, v)]
    rows = torch.stack(sides)  # [K/V, layers, blocks, block_size, kv_heads]
    weights = _weights(num_layers, block_size, total, k.device)[..., first : first + num_heads]
    sums = (rows.to(torch.int64) * weights).sum(dim=(0, 1, 3, 4))
    return tuple(int(s) & _MASK for s in sums.tolist())


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """``[layers, n, block_size, heads, head_dim]`` blocks (each head's row contiguous, of
    whole int32 words in every dtype here) -> the int32 sums of each head's row of each
    token, ``[layers, n, block_size, heads]``: the rows read as words in place, no copy."""
    return x.view(torch.int32).sum(dim=-1, dtype=torch.int32)


def _sums_by_runs(cache: torch.Tensor, runs: np.ndarray) -> torch.Tensor:
    """Row sums read in place, one reduction per run of consecutive ids."""
    return torch.cat([_row_sums(cache[:, first : first + count]) for first, count in runs.tolist()], dim=1)


GATHER_BYTES = 64 << 20  # at most this much of a cache copied at once by ``_gathered_sums``


def _gathered_sums(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Row sums of scattered blocks gathered into one buffer, ``GATHER_BYTES`` at a time."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
    per_block = max(1, cache[:, 0].numel() * cache.element_size())
    step = max(1, GATHER_BYTES // per_block)
    return torch.cat([_row_sums(cache.index_select(1, ids[i : i + step]))
                      for i in range(0, len(ids), step)], dim=1)  # fmt: skip


def check(meta: TransferMeta, got: tuple[int, ...]) -> None:
    """The receiver's sums against the sender's; raises ``TransferError("checksum")``."""
    want = meta.checksums
    if len(got) != len(want):
        raise TransferError("checksum", f"transfer {meta.transfer_id}: {len(want)} checksums for {len(got)} blocks")
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if bad:
        raise TransferError(
            "checksum", f"transfer {meta.transfer_id}: blocks {bad[:8]} of {len(want)} differ from what was sent"
        )
