"""The NCCL group on GPUs, through cupy: one rank on one device, two ranks on two, and
engines over it.

One rank: the collectives a TP worker runs (all-reduce, all-gather, the CPU side
channel's broadcast), a send to oneself where NCCL allows it (the test says why where
it does not), and an all-reduce captured in a CUDA graph (likewise). Two ranks, one
thread and one GPU each: a Megatron-split MLP and LM head whose all-reduce and
all-gather give the one-device result. Engines: at ``tensor_parallel_size=1`` over a
one-rank NCCL group (``engine.ranks.TensorParallel``) against Hugging Face
transformers' greedy tokens, and at 2 (rank processes on two GPUs, joined by NCCL)
against the one at 1.

The group's logic runs on CPU with a fake NCCL in ``tests/unit/test_nccl_group.py``;
here NCCL itself is checked, so without CUDA or cupy (the CPU suite; a machine without
the `gpu` extra) the tests skip, saying so. ``cupy`` is never imported here by name: the
image check imports every module these files name, and the CPU test environment has no
cupy (``engine.model.nccl.load_nccl`` imports it).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed import HashStore

from tests.gpu.device import ON_GPU
from tests.helpers import engine_greedy

needs_gpu = pytest.mark.skipif(
    not ON_GPU,
    reason="needs a CUDA device: NCCL moves device memory only (tests/unit/test_nccl_group.py "
    "checks the group's logic on CPU with a fake NCCL)",
)
needs_cupy = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is None,
    reason="cupy is not installed (the `gpu` extra's cupy-cuda13x, which the GPU image has)",
)
needs_two_gpus = pytest.mark.skipif(
    not ON_GPU or torch.cuda.device_count() < 2,
    reason=f"TP 2 needs two GPUs, one per rank; this machine has {torch.cuda.device_count()}",
)


def _on_ranks(size: int, fn: Callable[[int], object]) -> list:
    """``fn(rank)`` on a thread per rank with ``cuda:rank`` current; results in rank order."""

    def run(rank: int):
        torch.cuda.set_device(rank)
        return fn(rank)

    pool = ThreadPoolExecutor(size)
    try:
        futures = [pool.submit(run, rank) for rank in range(size)]
        return [f.result(timeout=120) for f in futures]
    finally:
        pool.shutdown(wait=False)  # a rank stuck in NCCL must not hang the test past its failure


@pytest.fixture(scope="module")
def one_rank():
    from engine.model.nccl import NcclGroup

    group = NcclGroup(HashStore(), 0, 1, timeout_s=30, device="cuda:0")
    yield group
    group.close()


@needs_cupy
@needs_gpu
def test_nccl_loads_and_says_its_versions(record_property):
    from engine.model.nccl import load_nccl, nccl_dtypes

    nccl = load_nccl()
    record_property("nccl_build_version", nccl.get_build_version())
    record_property("nccl_runtime_version", nccl.get_version())
    assert nccl.get_version() >= 2_07_00, "send/recv and group calls need NCCL 2.7 or later"
    assert torch.bfloat16 in nccl_dtypes(nccl), "this cupy has no NCCL_BFLOAT16: the models' default dtype"


@needs_cupy
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_one_rank_reduces_gathers_and_broadcasts(one_rank, dtype):
    x = (torch.arange(24, device="cuda:0") - 12).to(dtype).reshape(2, 3, 4)
    want = x.clone()
    assert one_rank.all_reduce(x) is x and torch.equal(x, want), "the sum over one rank is the tensor"
    strided = want.clone().transpose(0, 2)  # not contiguous: reduced through a copy, in place
    assert torch.equal(one_rank.all_reduce(strided), want.transpose(0, 2))
    for dim in (0, 1, -1):
        assert torch.equal(one_rank.all_gather(x, dim=dim), want), f"all_gather along {dim}"
    obj = {"step": 7, "tokens": [1, 2, 3]}
    assert one_rank.broadcast_object(obj) == obj
    torch.cuda.synchronize()


@needs_cupy
@needs_gpu
def test_one_rank_sends_to_itself(one_rank):
    sent = torch.arange(1000, dtype=torch.float32, device="cuda:0")
    got = torch.zeros_like(sent)
    try:
        one_rank.send_recv(sent, got, peer=0)
        torch.cuda.synchronize()
    except RuntimeError as e:  # cupy's NcclError is one
        pytest.skip(f"NCCL refuses a send to oneself here: {e}")
    assert torch.equal(got, sent)


@needs_cupy
@needs_gpu
def test_an_all_reduce_is_captured_in_a_cuda_graph_and_replays(one_rank):
    x = torch.ones(4096, device="cuda:0")
    one_rank.all_reduce(x)  # NCCL's first call sets up its buffers outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            one_rank.all_reduce(x.mul_(2))
    except RuntimeError as e:
        pytest.skip(f"cupy's NCCL call cannot be captured in a CUDA graph here: {e}")
    x.fill_(1.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3.0)), "the replay doubled and reduced over one rank"


def _mlp_and_head(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab, tokens = 64, 128, 96, 8
    return {
        "x": torch.randn(tokens, hidden, generator=g),
        "up": torch.randn(hidden, inter, generator=g) / hidden**0.5,
        "down": torch.randn(inter, hidden, generator=g) / inter**0.5,
        "head": torch.randn(vocab, hidden, generator=g) / hidden**0.5,
    }


def _tp_forward(group, w: dict, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP split by Megatron (up by columns, down by rows: one all-reduce) and the LM
    head by vocabulary rows (one all-gather), as a TP rank runs them."""
    dev = f"cuda:{rank}"
    inter, vocab = w["up"].shape[1] // size, w["head"].shape[0] // size
    up = w["up"][:, rank * inter : (rank + 1) * inter].to(dev)
    down = w["down"][rank * inter : (rank + 1) * inter].to(dev)
    h = group.all_reduce(torch.nn.functional.silu(w["x"].to(dev) @ up) @ down)
    logits = group.all_gather(h @ w["head"][rank * vocab : (rank + 1) * vocab].to(dev).T, dim=-1)
    return h.cpu(), logits.cpu()


@needs_cupy
@needs_two_gpus
def test_two_ranks_give_the_one_device_result():
    from engine.model.nccl import NcclGroup

    store, w = HashStore(), _mlp_and_head(seed=0)
    h1 = torch.nn.functional.silu(w["x"].cuda() @ w["up"].cuda()) @ w["down"].cuda()
    logits1 = (h1 @ w["head"].cuda().T).cpu()

    def rank_run(rank: int):
        group = NcclGroup(store, rank, 2, timeout_s=60, device=f"cuda:{rank}")
        try:
            h, logits = _tp_forward(group, w, rank, 2)
            a = torch.randn(4096, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
            summed = group.all_reduce(a.to(f"cuda:{rank}")).cpu()
            got = torch.zeros(8, device=f"cuda:{rank}")
            group.send_recv(torch.full((8,), float(rank), device=f"cuda:{rank}"), got, peer=1 - rank)
            obj = group.broadcast_object({"from": rank} if rank == 0 else None)
            torch.cuda.synchronize()
            return h, logits, summed, got.cpu(), obj
        finally:
            group.close()

    results = _on_ranks(2, rank_run)
    a = [torch.randn(4096, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(2)]
    for rank, (h, logits, summed, got, obj) in enumerate(results):
        torch.testing.assert_close(h, h1.cpu(), rtol=1e-4, atol=1e-5, msg=f"rank {rank}'s all-reduced MLP")
        torch.testing.assert_close(logits, logits1, rtol=1e-4, atol=1e-5, msg=f"rank {rank}'s gathered logits")
        assert torch.equal(logits.argmax(-1), logits1.argmax(-1)), f"rank {rank}'s greedy tokens"
        assert torch.equal(summed, a[0] + a[1]), "two bf16 addends round once, as torch's add does"
        assert torch.equal(got, torch.full((8,), float(1 - rank))), f"rank {rank} got its peer's send"
        assert obj == {"from": 0}


def _prompts(model_dir) -> list[list[int]]:
    from engine.model.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(str(model_dir)).vocab_size
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12, 19, 26, 33, 40, 51, 64)]


# No graph capture: it takes seconds of the step's limit and checks nothing of the group.
ENGINE = dict(device="cuda", dtype="float32", cuda_graphs=False, kv_cache_memory=256 << 20)


@needs_cupy
@needs_gpu
def test_a_tp1_engine_over_a_one_rank_nccl_group_matches_hf_greedy(default_model):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model.nccl import NcclGroup
    from engine.ranks import TensorParallel
    from tests.gpu.test_engine_parity import _assert_same_but_near_ties
    from tests.unit.test_hf_parity import _hf_greedy, _hf_model

    group = NcclGroup(HashStore(), 0, 1, timeout_s=30, device="cuda:0")
    config = EngineConfig(model=str(default_model), tensor_parallel_size=1, **ENGINE)
    engine = LLMEngine(config, tensor_parallel=TensorParallel(group))
    prompts = _prompts(default_model)
    try:
        got = engine_greedy(engine, prompts, 8)
        assert engine.stats().num_blocks_in_use == 0, "KV blocks leaked"
    finally:
        engine.close()
    assert group._comm is None, "closing the engine closes its group"
    model = _hf_model(str(default_model), torch.float32, "cuda")
    _assert_same_but_near_ties(model, prompts, got, _hf_greedy(model, prompts, [8] * len(prompts)))


@needs_cupy
@needs_two_gpus
def test_a_tp2_engine_over_nccl_gives_the_tp1_greedy_tokens(default_model):
    from engine import LLM
    from tests.gpu.test_engine_parity import _assert_same_but_near_ties
    from tests.unit.test_hf_parity import _hf_model

    prompts = _prompts(default_model)
    with LLM(model=str(default_model), tensor_parallel_size=1, **ENGINE) as tp1:
        want = engine_greedy(tp1.engine, prompts, 8)
    with LLM(model=str(default_model), tensor_parallel_size=2, **ENGINE) as tp2:
        got = engine_greedy(tp2.engine, prompts, 8)
        assert type(tp2.engine.tensor_parallel.group).__name__ == "NcclGroup"
    # Where the ranks' other summation order breaks a float32 tie, HF's logits show the tie.
    _assert_same_but_near_ties(_hf_model(str(default_model), torch.float32, "cuda"), prompts, got, want)
