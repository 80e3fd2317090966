"""The NCCL group's own logic, on CPU, without cupy: a fake ``cupy.cuda.nccl`` whose ranks
are threads of this process and whose pointers are CPU memory stands in for NCCL.

It checks what the group hands NCCL (pointers, element counts, data types, the stream),
how the ranks meet in the store (the unique id's bytes, the deadlines), the all-gather's
reshaping against ``torch.cat``, the CPU side channel, and an engine split over two ranks
(threads) through it against the one-rank engine. The same group on GPUs, with the real
NCCL, is ``tests/gpu/test_nccl_group.py``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import queue
import sys
import threading
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed import HashStore

import engine.model.nccl as nccl_module
from engine.model.nccl import (
    NCCL_UNIQUE_ID_BYTES,
    NcclGroup,
    decode_unique_id,
    encode_unique_id,
    exchange_unique_id,
    gathered_along,
    load_nccl,
    nccl_dtypes,
)
from tests.helpers import engine_greedy


def _memory(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``count`` elements of ``dtype`` at address ``ptr``, as a tensor sharing them."""
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_byte * nbytes).from_address(ptr), dtype=dtype)


class _World:
    """The ranks of one fake communicator: they meet at every collective."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.deposits: list[torch.Tensor | None] = [None] * size
        self.mail: dict[tuple[int, int], queue.Queue] = {
            pair: queue.Queue() for pair in itertools.product(range(size), repeat=2)
        }

    def exchange(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``value``, once all have given theirs."""
        self.deposits[rank] = value
        self.barrier.wait()
        values = list(self.deposits)
        self.barrier.wait()  # nobody deposits the next collective's value before all have read
        return values  # type: ignore[return-value]


class FakeNccl:
    """``cupy.cuda.nccl`` as the group uses it, over threads: it records each call."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64 = 0, 1, 2, 3, 4
    NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 5, 6, 7, 8, 9
    NCCL_SUM = 0
    TORCH = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 4: torch.int64, 6: torch.float16,
             7: torch.float32, 8: torch.float64, 9: torch.bfloat16}  # fmt: skip

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worlds: dict[tuple[int, ...], _World] = {}
        self.ids_made = 0
        self.calls: list[tuple] = []
        self.open_groups = 0

    def get_unique_id(self) -> tuple[int, ...]:
        with self.lock:
            self.ids_made += 1
            n = self.ids_made
        return tuple((i * 37 + n) % 256 - 128 for i in range(NCCL_UNIQUE_ID_BYTES))  # C chars, some negative

    def groupStart(self) -> None:  # noqa: N802 (cupy's names)
        self.open_groups += 1

    def groupEnd(self) -> None:  # noqa: N802
        self.open_groups -= 1

    def NcclCommunicator(self, ndev: int, comm_id: tuple, rank: int):  # noqa: N802
        assert isinstance(comm_id, tuple) and len(comm_id) == NCCL_UNIQUE_ID_BYTES
        assert all(-128 <= c <= 127 for c in comm_id), "cupy takes signed C chars on this machine"
        with self.lock:
            world = self.worlds.setdefault(comm_id, _World(ndev))
        world.barrier.wait()  # ncclCommInitRank returns once every rank has called it
        return _FakeComm(self, world, rank)


class _FakeComm:
    def __init__(self, nccl: FakeNccl, world: _World, rank: int) -> None:
        self.nccl, self.world, self.rank = nccl, world, rank
        self.aborted = False

    def _record(self, *call) -> None:
        with self.nccl.lock:
            self.nccl.calls.append((self.rank, *call))

    def allReduce(self, send, recv, count, datatype, op, stream):  # noqa: N802
        self._record("allReduce", count, datatype, stream)
        assert op == FakeNccl.NCCL_SUM
        dtype = FakeNccl.TORCH[datatype]
        parts = self.world.exchange(self.rank, _memory(send, count, dtype).clone())
        _memory(recv, count, dtype).copy_(torch.stack(parts).sum(0))

    def allGather(self, send, recv, count, datatype, stream):  # noqa: N802
        self._record("allGather", count, datatype, stream)
        dtype = FakeNccl.TORCH[datatype]
        parts = self.world.exchange(self.rank, _memory(send, count, dtype).clone())
        _memory(recv, count * self.world.size, dtype).copy_(torch.cat(parts))

    def send(self, buf, count, datatype, peer, stream):
        assert self.nccl.open_groups, "a send outside a group call"
        self._record("send", count, datatype, stream)
        self.world.mail[self.rank, peer].put(_memory(buf, count, FakeNccl.TORCH[datatype]).clone())

    def recv(self, buf, count, datatype, peer, stream):
        self._record("recv", count, datatype, stream)
        _memory(buf, count, FakeNccl.TORCH[datatype]).copy_(self.world.mail[peer, self.rank].get(timeout=10))

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def fake_nccl(monkeypatch) -> FakeNccl:
    fake = FakeNccl()
    monkeypatch.setattr(nccl_module, "load_nccl", lambda: fake)
    return fake


def _on_ranks(size: int, fn: Callable[[int], object]) -> list:
    """``fn(rank)`` for each rank, each on its own thread; their results in rank order."""
    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(fn, rank) for rank in range(size)]
        return [f.result(timeout=60) for f in futures]


def _groups(size: int) -> list[NcclGroup]:
    store = HashStore()
    return _on_ranks(size, lambda rank: NcclGroup(store, rank, size, timeout_s=10, device="cpu"))


# -- pure parts ---------------------------------------------------------------------------


def test_torch_dtypes_map_to_nccls_and_bfloat16_only_where_cupy_names_it(fake_nccl):
    got = nccl_dtypes(fake_nccl)
    assert got[torch.float32] == FakeNccl.NCCL_FLOAT32 and got[torch.float16] == FakeNccl.NCCL_FLOAT16
    assert got[torch.bfloat16] == FakeNccl.NCCL_BFLOAT16 and got[torch.int64] == FakeNccl.NCCL_INT64
    assert torch.bool not in got, "NCCL sums bool as uint8 (wraps), not as torch's logical or"

    names = {k: v for k, v in vars(FakeNccl).items() if k.startswith("NCCL_") and k != "NCCL_BFLOAT16"}
    older = types.SimpleNamespace(**names)
    assert torch.bfloat16 not in nccl_dtypes(older), "a cupy without NCCL_BFLOAT16 maps no bfloat16"
    assert nccl_dtypes(older)[torch.float32] == FakeNccl.NCCL_FLOAT32


@pytest.mark.parametrize("signed", [True, False])
def test_the_unique_id_crosses_the_store_as_bytes_and_comes_back_as_cupy_gave_it(signed):
    unique_id = tuple(range(-128, 0)) if signed else tuple(range(128, 256))
    data = encode_unique_id(unique_id)
    assert isinstance(data, bytes) and len(data) == NCCL_UNIQUE_ID_BYTES
    assert decode_unique_id(data, signed=signed) == unique_id
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        encode_unique_id((1, 2, 3))
    with pytest.raises(ValueError, match="128 bytes, got 5"):
        decode_unique_id(b"short")


def test_every_rank_gets_rank_0s_unique_id_which_only_rank_0_makes():
    store, made = HashStore(), []

    def make_id():
        made.append(1)
        return tuple(range(-64, 64))

    ids = _on_ranks(3, lambda rank: exchange_unique_id(store, rank, 3, make_id, timeout_s=10))
    assert ids == [tuple(range(-64, 64))] * 3 and len(made) == 1


def test_a_rank_whose_rank_0_never_comes_fails_by_its_deadline_naming_what_it_waited_for():
    with pytest.raises(TimeoutError, match=r"rank 1 of 2: rank 0's NCCL unique id: \['unique_id'\] not there"):
        exchange_unique_id(HashStore(), 1, 2, lambda: pytest.fail("only rank 0 makes the id"), timeout_s=0.2)


def test_rank_0_fails_by_its_deadline_naming_the_ranks_that_never_checked_in():
    with pytest.raises(TimeoutError, match=r"\['ready/1', 'ready/2'\] not there after 0.2s"):
        exchange_unique_id(HashStore(), 0, 3, lambda: tuple([0] * NCCL_UNIQUE_ID_BYTES), timeout_s=0.2)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_gathered_along_concatenates_the_ranks_tensors_in_rank_order(dim):
    parts = [torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    assert torch.equal(gathered_along(torch.stack(parts), dim), torch.cat(parts, dim=dim))


def test_without_cupy_the_group_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.delitem(sys.modules, "cupy.cuda", raising=False)
    with pytest.raises(RuntimeError, match="needs cupy with NCCL.*cupy-cuda13x"):
        load_nccl()


# -- the group over the fake NCCL -------------------------------------------------------------


def test_all_reduce_sums_in_place_over_the_ranks_on_the_current_stream(fake_nccl):
    groups = _groups(2)

    def run(rank):
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        out = groups[rank].all_reduce(t)
        strided = (torch.arange(12, dtype=torch.int64).reshape(3, 4) * (rank + 1)).t()  # not contiguous
        groups[rank].all_reduce(strided)
        return t, out, strided

    for t, out, strided in _on_ranks(2, run):
        assert out is t and torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3) * 3)
        assert torch.equal(strided, (torch.arange(12).reshape(3, 4) * 3).t())
    reduces = [c for c in fake_nccl.calls if c[1] == "allReduce"]
    assert sorted(c[2:] for c in reduces) == [(6, FakeNccl.NCCL_FLOAT32, 0)] * 2 + [(12, FakeNccl.NCCL_INT64, 0)] * 2


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_joins_the_ranks_tensors_along_dim_like_torch_cat(fake_nccl, dim):
    groups = _groups(3)
    parts = [torch.randn(2, 5, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(3)]
    got = _on_ranks(3, lambda rank: groups[rank].all_gather(parts[rank], dim=dim))
    for g in got:
        assert torch.equal(g, torch.cat(parts, dim=dim))
    gathers = [c[2:] for c in fake_nccl.calls if c[1] == "allGather"]
    assert gathers == [(10, FakeNccl.NCCL_BFLOAT16, 0)] * 3, "counts are elements, not bytes"


def test_broadcast_object_hands_rank_0s_object_to_every_rank(fake_nccl):
    groups = _groups(2)
    sent = {"step": 3, "tokens": [1, 2, 3]}
    got = _on_ranks(2, lambda rank: groups[rank].broadcast_object(sent if rank == 0 else None))
    assert got == [sent, sent]


def test_send_recv_exchanges_between_ranks_and_with_oneself_in_one_group_call(fake_nccl):
    groups = _groups(2)

    def run(rank):
        g = groups[rank]
        to_peer, from_peer = torch.full((4,), float(rank + 1)), torch.zeros(4)
        g.send_recv(to_peer, from_peer, peer=1 - rank)
        mine = torch.zeros(4)
        g.send_recv(to_peer, mine, peer=rank)
        return from_peer, mine

    (from_1, self_0), (from_0, self_1) = _on_ranks(2, run)
    assert torch.equal(from_1, torch.full((4,), 2.0)) and torch.equal(from_0, torch.full((4,), 1.0))
    assert torch.equal(self_0, torch.full((4,), 1.0)) and torch.equal(self_1, torch.full((4,), 2.0))
    assert fake_nccl.open_groups == 0


def test_tensors_off_the_groups_device_of_a_type_nccl_lacks_or_after_close_are_refused(fake_nccl):
    (group,) = _groups(1)
    with pytest.raises(ValueError, match="runs on cpu, got a tensor on meta"):
        group.all_reduce(torch.empty(2, device="meta"))
    with pytest.raises(TypeError, match="no data type for torch.bool"):
        group.all_reduce(torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one dimension"):
        group.all_gather(torch.tensor(1.0))
    comm = group._comm
    group.close()
    group.close()  # twice is fine
    assert comm.aborted, "closing aborts: it must not wait on a collective a dead peer left"
    with pytest.raises(RuntimeError, match="closed"):
        group.all_reduce(torch.zeros(2))
    with pytest.raises(RuntimeError, match="closed"):
        group.broadcast_object(1)


def test_a_group_of_one_is_the_identity(fake_nccl):
    (group,) = _groups(1)
    t = torch.randn(3, 4)
    want = t.clone()
    assert torch.equal(group.all_reduce(t), want)
    assert torch.equal(group.all_gather(t, dim=0), want)
    assert group.broadcast_object("x") == "x"


def test_two_groups_on_one_store_under_other_prefixes_stay_apart(fake_nccl):
    store = HashStore()
    a = _on_ranks(2, lambda r: NcclGroup(store, r, 2, prefix="a", timeout_s=10, device="cpu"))
    b = _on_ranks(2, lambda r: NcclGroup(store, r, 2, prefix="b", timeout_s=10, device="cpu"))
    assert fake_nccl.ids_made == 2 and len(fake_nccl.worlds) == 2
    assert a[0]._comm.world is not b[0]._comm.world
    assert store.check(["a/nccl/unique_id", "b/nccl/unique_id"])


# -- an engine over it ------------------------------------------------------------------------


def test_a_tp2_engine_over_the_group_gives_the_tp1_tokens(fake_nccl, default_model):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.ranks import RankLoop, TensorParallel

    config = EngineConfig(
        model=str(default_model), dtype="float32", kv_cache_memory=32 << 20, swap_space=0, tensor_parallel_size=2
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (5, 17, 30)]
    want = engine_greedy(LLMEngine(dataclasses.replace(config, tensor_parallel_size=1)), prompts, 6)
    groups = _groups(2)
    with ThreadPoolExecutor(1) as pool:
        rank_1 = pool.submit(lambda: RankLoop(config, groups[1], "cpu").run())
        engine = LLMEngine(config, tensor_parallel=TensorParallel(groups[0]))
        got = engine_greedy(engine, prompts, 6)
        engine.close()
        assert rank_1.result(timeout=60) > 0, "rank 1 ran the steps"
    assert got == want, "the model split over two ranks, through the group, gives the one-rank tokens"
    ops = {c[1] for c in fake_nccl.calls}
    assert ops == {"allReduce", "allGather"}, f"the forward's collectives went through NCCL: {ops}"


