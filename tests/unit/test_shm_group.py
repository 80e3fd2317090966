"""The shared-memory group's collectives against torch's own arithmetic, its ranks threads of
this process on one in-process store (the offline engine's spawned ranks run the same group
across processes: tests/unit/test_tp_engine.py)."""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.distributed import HashStore

from engine.model import shm_group
from engine.model.shm_group import SLOT_BYTES, SharedMemoryGroup

pytestmark = pytest.mark.skipif(not shm_group.supported(), reason="the group runs where stores stay in order (x86-64)")

_prefixes = itertools.count()


def _on_ranks(size: int, work, **group_kwargs) -> list:
    """``work(group)`` on ``size`` ranks (threads) of one fresh group; their results, rank order."""
    store, prefix = HashStore(), f"g{next(_prefixes)}"

    def rank(r: int):
        group = SharedMemoryGroup(store, r, size, prefix=prefix, timeout_s=20, **group_kwargs)
        try:
            return work(group)
        finally:
            group.close()

    with ThreadPoolExecutor(size) as pool:
        return [f.result(timeout=60) for f in [pool.submit(rank, r) for r in range(size)]]


def _tensor(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(dtype)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_sums_in_rank_order_the_same_bits_on_every_rank(size, dtype):
    shape = (5, 7)
    want = sum((_tensor(r, shape, dtype) for r in range(1, size)), _tensor(0, shape, dtype))

    def work(group):
        t = _tensor(group.rank, shape, dtype)
        assert group.all_reduce(t) is t, "in place"
        return t

    for got in _on_ranks(size, work):
        assert torch.equal(got, want)


def test_a_tensor_larger_than_a_slot_is_reduced_and_gathered_a_slot_at_a_time():
    numel = SLOT_BYTES // 4 * 2 + 3  # three rounds of float32

    def work(group):
        reduced = group.all_reduce(_tensor(group.rank, numel))
        gathered = group.all_gather(_tensor(group.rank, numel), dim=0)
        return reduced, gathered

    for reduced, gathered in _on_ranks(2, work):
        assert torch.equal(reduced, _tensor(0, numel) + _tensor(1, numel))
        assert torch.equal(gathered, torch.cat([_tensor(0, numel), _tensor(1, numel)]))


def test_all_gather_joins_along_any_dimension_and_a_strided_tensor_is_reduced_in_place():
    def work(group):
        t = _tensor(group.rank, (3, 4, 2))
        joined = [group.all_gather(t, dim=d) for d in (0, 1, -1)]
        strided = _tensor(group.rank, (4, 6)).t()  # not contiguous
        group.all_reduce(strided)
        return joined, strided

    parts = [_tensor(r, (3, 4, 2)) for r in range(2)]
    for joined, strided in _on_ranks(2, work):
        for d, got in zip((0, 1, -1), joined):
            assert torch.equal(got, torch.cat(parts, dim=d))
        assert torch.equal(strided, (_tensor(0, (4, 6)) + _tensor(1, (4, 6))).t())


def test_broadcast_object_gives_every_rank_rank_zeros_object_small_or_larger_than_a_slot():
    big = list(range(SLOT_BYTES // 2))  # a pickle of several slots

    def work(group):
        small = group.broadcast_object({"step": [1, 2, 3]} if group.rank == 0 else None)
        return small, group.broadcast_object(big if group.rank == 0 else None)

    assert _on_ranks(2, work) == [({"step": [1, 2, 3]}, big)] * 2


def _two_ranks(rank0, rank1, timeout_s: float = 20, peers_alive=lambda: True) -> list:
    """``rank0(group)`` and ``rank1(group)`` on the two ranks of a fresh group (threads)."""
    store, prefix = HashStore(), f"g{next(_prefixes)}"

    def rank(r: int):
        group = SharedMemoryGroup(store, r, 2, prefix=prefix, timeout_s=timeout_s, peers_alive=peers_alive)
        return (rank0, rank1)[r](group)

    with ThreadPoolExecutor(2) as pool:
        return [f.result(timeout=30) for f in [pool.submit(rank, r) for r in range(2)]]


def test_a_wait_on_a_rank_whose_process_is_gone_raises_naming_the_ranks_behind():
    alive = threading.Event()
    alive.set()

    def rank0(group):
        alive.clear()  # rank 1 has joined (the group is built): now its process "exits"
        with pytest.raises(RuntimeError, match=r"a rank in \[1\] is gone"):
            group.all_reduce(torch.ones(3))
        return "raised"

    assert _two_ranks(rank0, lambda group: None, peers_alive=alive.is_set) == ["raised", None]


def test_a_collective_a_rank_never_reaches_times_out_naming_it():
    def rank0(group):
        with pytest.raises(TimeoutError, match=r"ranks \[1\] did not reach round 1 within"):
            group.all_reduce(torch.ones(3))
        return "raised"

    assert _two_ranks(rank0, lambda group: None, timeout_s=0.3) == ["raised", None]


def test_a_rank_waits_for_the_next_broadcast_past_the_timeout():
    def rank0(group):
        time.sleep(0.6)  # an idle engine: twice the timeout before the next step
        return group.broadcast_object("next step")

    assert _two_ranks(rank0, lambda group: group.broadcast_object(), timeout_s=0.3) == ["next step"] * 2


def test_the_mapped_file_is_unlinked_once_every_rank_has_mapped_it():
    before = set(os.listdir(shm_group._shm_dir()))
    _on_ranks(2, lambda g: g.all_reduce(torch.ones(2)))
    left = {n for n in set(os.listdir(shm_group._shm_dir())) - before if n.startswith("tandem-tp-")}
    assert not left, f"left behind in {Path(shm_group._shm_dir())}: {left}"


def test_a_rank_on_another_host_is_refused_rather_than_given_a_private_mapping(tmp_path):
    store = HashStore()
    store.set("far/shm/path", str(tmp_path / "on-rank-0s-host-only"))  # a path this "host" lacks
    with pytest.raises(RuntimeError, match="needs every rank on one host"):
        SharedMemoryGroup(store, 1, 2, prefix="far", timeout_s=5)
    assert not (tmp_path / "on-rank-0s-host-only").exists()
