"""Per-block checksums of KV, so that a corrupt or misdirected block fails its transfer.

The sender sums each block it offers (``TransferMeta.checksums``, one per block, in the
transfer's order) and the receiver sums the blocks it read into; a difference is a
``TransferError("checksum")``, never KV served. A setting (``TransferConfig.checksums``),
on in the tests and chaos runs, off by default: each side reads every byte once more.

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
    segment = -(-words // SEGMENTS)
    # Stretch sums of every block, one reduction per run of consecutive ids and per K or
    # V (scattered blocks cost a call each), weighted once at the end.
    runs, _ = contiguous_runs(block_ids, range(len(block_ids)))
    parts: tuple[list, list] = ([], [])
    for first, count in runs.tolist():
        for side, cache in zip(parts, (k, v)):
            # int32 words of each (layer, block), padded to whole stretches; a view, no copy,
            # when the block's size is a multiple of SEGMENTS words (as every layout here is).
            x = cache[:, first : first + count].reshape(num_layers, count, -1).view(torch.int32)
            if words % SEGMENTS:
                x = torch.nn.functional.pad(x, (0, segment * SEGMENTS - words))
            side.append(x.view(num_layers, count, SEGMENTS, segment).sum(dim=3, dtype=torch.int32))
    stretch = torch.stack([torch.cat(side, dim=1) for side in parts])  # [K/V, layers, blocks, SEGMENTS]
    sums = (stretch.to(torch.int64) * _weights(num_layers, k.device)).sum(dim=(0, 1, 3))
    return tuple(int(s) & _MASK for s in sums.tolist())


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
