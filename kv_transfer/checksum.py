"""Per-block checksums of KV, so that a corrupt or misdirected block fails its transfer.

The sender sums each block it offers (``TransferMeta.checksums``, one per block, in the
transfer's order) and the receiver sums the blocks it read into; a difference is a
``TransferError("checksum")``, never KV served. A setting (``TransferConfig.checksums``),
on by default: each side reads every byte once more, which costs little beside the read
and the prefill (docs/BENCHMARKS.md), and a bug that hands a reader the wrong blocks then
fails loudly instead of streaming another prompt's continuation.

The sum is a position-weighted word checksum, not a cryptographic hash: the block's
bytes as int32 words, summed (wrapping) in ``SEGMENTS`` stretches per layer and per K and
V, and the stretches combined with odd weights. It runs at memory speed (one vectorised
pass, no copy of the blocks) and catches what a transfer can get wrong: another block's
or another request's KV, a missing or changed word, layers or stretches of a block
swapped. Peers inside the cluster are trusted (SECURITY.md); nothing here resists one
that forges KV.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kv_transfer.base import TransferError, TransferMeta, contiguous_runs

SEGMENTS = 16  # stretches per layer and block: a swap of two of them changes the sum
_MASK = (1 << 32) - 1


@functools.lru_cache(maxsize=16)
def _weights(num_layers: int, device: torch.device) -> torch.Tensor:
    """Odd int64 weights per (K or V, layer, stretch), the same on every process."""
    g = torch.Generator().manual_seed(0x7A4D)
    w = torch.randint(1, 1 << 31, (2, num_layers, SEGMENTS), generator=g, dtype=torch.int64)
    return (w | 1)[:, :, None, :].to(device)


def block_checksums(k: torch.Tensor, v: torch.Tensor, block_ids: list[int]) -> tuple[int, ...]:
    """One checksum per block of ``block_ids`` (in that order) of a ``[layers, blocks, ...]``
    K and V (a paged cache, or packed KV with ``range`` ids)."""
    if not len(block_ids):
        return ()
    num_layers = k.shape[0]
    words = k[0, 0].numel() * k.element_size() // 4
    runs, _ = contiguous_runs(block_ids, range(len(block_ids)))
    # On a GPU a call per run of scattered blocks costs a launch each (18.9 GB/s over
    # 256 blocks on an H200, against 717 in one run); gathering them first costs a copy
    # at HBM speed. On a CPU the copy costs more than the calls.
    if len(runs) > 1 and k.device.type != "cpu":
        sides = [_gathered_sums(cache, block_ids, words) for cache in (k, v)]
    else:
        sides = [_sums_by_runs(cache, runs, words) for cache in (k, v)]
    stretch = torch.stack(sides)  # [K/V, layers, blocks, SEGMENTS]
    sums = (stretch.to(torch.int64) * _weights(num_layers, k.device)).sum(dim=(0, 1, 3))
    return tuple(int(s) & _MASK for s in sums.tolist())


def _segment_sums(x: torch.Tensor, words: int) -> torch.Tensor:
    """``[layers, n, ...]`` blocks (contiguous from dim 1 on) -> their int32 stretch sums
    ``[layers, n, SEGMENTS]``; the words of each block padded to whole stretches (a view,
    no copy, when a block's size is a multiple of SEGMENTS words, as every layout here is)."""
    layers, n = x.shape[:2]
    x = x.reshape(layers, n, -1).view(torch.int32)
    segment = -(-words // SEGMENTS)
    if words % SEGMENTS:
        x = torch.nn.functional.pad(x, (0, segment * SEGMENTS - words))
    return x.view(layers, n, SEGMENTS, segment).sum(dim=3, dtype=torch.int32)


def _sums_by_runs(cache: torch.Tensor, runs: np.ndarray, words: int) -> torch.Tensor:
    """Stretch sums read in place, one reduction per run of consecutive ids."""
    return torch.cat([_segment_sums(cache[:, first : first + count], words) for first, count in runs.tolist()], dim=1)


GATHER_BYTES = 64 << 20  # at most this much of a cache copied at once by ``_gathered_sums``


def _gathered_sums(cache: torch.Tensor, block_ids: list[int], words: int) -> torch.Tensor:
    """Stretch sums of scattered blocks gathered into one buffer, ``GATHER_BYTES`` at a time."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
    per_block = max(1, cache[:, 0].numel() * cache.element_size())
    step = max(1, GATHER_BYTES // per_block)
    return torch.cat([_segment_sums(cache.index_select(1, ids[i : i + step]), words)
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
