"""Per-block KV checksums (``kv_transfer.checksum``): what they must tell apart."""

from __future__ import annotations

import pytest
import torch

from engine.wire.messages import KVLayout
from kv_transfer.base import TransferError, TransferMeta
from kv_transfer.checksum import block_checksums, check
from kv_transfer.config import TransferConfig


def _cache(dtype=torch.float32, blocks: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (3, blocks, 4, 2, 8)  # [layers, blocks, block_size, kv_heads, head_dim]
    return tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_sums_the_same_wherever_it_lies_and_in_any_order(dtype):
    k, v = _cache(dtype)
    packed = (k[:, [5, 1, 2]].contiguous(), v[:, [5, 1, 2]].contiguous())
    assert block_checksums(k, v, [5, 1, 2]) == block_checksums(*packed, [0, 1, 2])
    assert block_checksums(k, v, [2, 1, 5]) == tuple(reversed(block_checksums(k, v, [5, 1, 2])))


def test_scattered_blocks_gathered_in_pieces_sum_as_when_read_in_place(monkeypatch):
    """A GPU gathers scattered blocks before summing them (a launch per run costs more than
    the copy there): the same sums as reading each run in place, however small the pieces."""
    from kv_transfer import checksum
    from kv_transfer.base import contiguous_runs

    k, _ = _cache(torch.bfloat16, blocks=12)
    ids = [7, 2, 3, 11, 0, 5, 6]
    runs, _ = contiguous_runs(ids, range(len(ids)))
    in_place = checksum._sums_by_runs(k, runs)
    assert in_place.shape == (3, len(ids), 4, 2)
    block_bytes = k[:, 0].numel() * k.element_size()
    for piece in (1, 2, 100):  # blocks per gathered piece
        monkeypatch.setattr(checksum, "GATHER_BYTES", piece * block_bytes)
        assert torch.equal(checksum._gathered_sums(k, ids), in_place)


@pytest.mark.parametrize(
    "change", ["word", "layers swapped", "tokens swapped", "heads swapped", "k and v swapped", "other block"]
)
def test_what_a_transfer_can_get_wrong_changes_the_block_sum(change):
    k, v = _cache()
    before = block_checksums(k, v, [3])
    k2, v2 = k.clone(), v.clone()
    if change == "word":
        k2[2, 3, 1, 0, 4] += 1e-6
    elif change == "layers swapped":
        k2[0, 3], k2[1, 3] = k[1, 3].clone(), k[0, 3].clone()
    elif change == "tokens swapped":
        k2[1, 3, 0], k2[1, 3, 3] = k[1, 3, 3].clone(), k[1, 3, 0].clone()
    elif change == "heads swapped":
        k2[1, 3, :, 0], k2[1, 3, :, 1] = k[1, 3, :, 1].clone(), k[1, 3, :, 0].clone()
    elif change == "k and v swapped":
        k2[:, 3], v2[:, 3] = v[:, 3].clone(), k[:, 3].clone()
    else:
        k2[:, 3], v2[:, 3] = k[:, 4], v[:, 4]
    assert block_checksums(k2, v2, [3]) != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cuts", [(0, 4), (0, 2, 4), (0, 1, 2, 3, 4), (0, 1, 4)])
def test_the_sums_of_a_blocks_heads_in_any_split_add_up_to_the_blocks_sum(dtype, cuts):
    """Tensor-parallel ranks each sum the KV heads they hold: a sender and a receiver that
    split the heads differently still compare one number a block."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 6, 4, 4, 8, generator=g).to(dtype) for _ in range(2))
    ids = [4, 0, 5]
    whole = block_checksums(k, v, ids)
    parts = [block_checksums(k[:, :, :, a:b].contiguous(), v[:, :, :, a:b].contiguous(), ids, heads=(a, 4))
             for a, b in zip(cuts, cuts[1:])]
    assert tuple(sum(col) & 0xFFFFFFFF for col in zip(*parts)) == whole
    with pytest.raises(ValueError, match="not within the model's 4"):
        block_checksums(k[:, :, :, :2].contiguous(), v[:, :, :, :2].contiguous(), ids, heads=(3, 4))


def test_check_names_the_blocks_that_differ():
    layout = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    meta = TransferMeta("t", "r", layout, num_blocks=3, num_tokens=12, checksums=(1, 2, 3))
    check(meta, (1, 2, 3))
    with pytest.raises(TransferError, match=r"blocks \[1\]") as e:
        check(meta, (1, 5, 3))
    assert e.value.reason == "checksum"
    with pytest.raises(TransferError, match="3 checksums for 2 blocks"):
        check(meta, (1, 2))


def test_checksums_are_on_by_default_and_a_setting():
    assert TransferConfig().checksums, "a block that is not what was sent must fail loudly unless turned off"
    assert not TransferConfig.from_dict({"checksums": False}).checksums
