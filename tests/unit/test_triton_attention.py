"""The Triton attention kernels agree with the torch reference backend.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET
must be set before triton (and ``engine.model.triton_attention``, whose kernels are
decorated on import) is first imported, so this module sets it at the top. It only
matters on machines where compiled Triton kernels could not run anyway. With CUDA
the same tests run the compiled kernels on the GPU.

Each case builds one step's batch at random (ragged contexts, shuffled blocks), runs
it through both backends' ``forward`` on copies of one cache, and compares the
outputs (tolerance per dtype) and the written caches (exact).
"""

import os
import random

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip(
    "triton", reason="triton is not installed (it comes with the test and gpu extras)"
)

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model import triton_attention  # noqa: E402
from engine.model.attention import TorchAttention, resolve_attention_backend, write_kv  # noqa: E402
from engine.model.triton_attention import TritonAttention  # noqa: E402
from tests.helpers import build_hf_checkpoint, random_step_layout  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# fp32 is exact up to summation order; fp16/bf16 round the output (and on a GPU the
# probabilities before the P@V product) to 11 and 8 significant bits.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = list(TOLERANCE)
NUM_BLOCKS = 96


def _compare(
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    decode_lens: list[int],
    chunks: list[tuple[int, int]],
    partition_size: int = 32,
    seed: int = 0,
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout = random_step_layout(block_size, decode_lens, chunks, rng, NUM_BLOCKS)
    rows = len(layout.slots)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    cache_shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*cache_shape), randn(*cache_shape)
    q = randn(rows, num_heads, head_dim)
    # K and V as the model makes them: views into one fused projection, not contiguous.
    kv = randn(rows, 2 * num_kv_heads * head_dim)
    k = kv[:, : num_kv_heads * head_dim].view(rows, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim :].view(rows, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    ref_backend = TorchAttention(block_size, DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = ref_backend.forward(q, k, v, ref_k, ref_v, ref_backend.build_metadata(layout), scale)
    backend = TritonAttention(block_size, DEVICE, head_dim, partition_size=partition_size)
    got = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout), scale)

    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), (
        "caches differ after the K/V write"
    )
    case = f"{dtype}, block {block_size}, {num_heads}/{num_kv_heads} heads, d={head_dim}"
    torch.testing.assert_close(
        got.float(), want.float(), **TOLERANCE[dtype], msg=lambda m: f"{case}: {m}"
    )


# (block size, query heads, KV heads): GQA ratios 1, 4 and 8 over three block sizes.
SHAPES = [(8, 4, 4), (16, 8, 2), (32, 8, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"block{s[0]}-gqa{s[1] // s[2]}")
def test_decode_with_split_k_over_ragged_contexts_matches_torch(dtype, shape):
    # Partitions of 32 tokens: the longest context spans 5, the shortest one.
    _compare(dtype, *shape, head_dim=64, decode_lens=[1, 7, 32, 33, 90, 131], chunks=[])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_within_one_partition_skips_the_reduce_and_matches_torch(dtype):
    _compare(dtype, 16, 8, 2, 64, decode_lens=[3, 17, 64], chunks=[], partition_size=64)


def test_split_k_buffers_are_made_once_per_step_and_every_layer_stays_right():
    block_size, heads, kv_heads, head_dim = 16, 8, 2, 32
    layout = random_step_layout(block_size, [20, 70, 100], [], random.Random(0), NUM_BLOCKS)
    backend = TritonAttention(block_size, DEVICE, head_dim, partition_size=32)
    meta = backend.build_metadata(layout)
    ref = TorchAttention(block_size, DEVICE)
    ref_meta = ref.build_metadata(layout)
    gen = torch.Generator().manual_seed(0)
    made = []
    for layer in range(3):  # the layers of one step share the metadata
        cache = [torch.randn(NUM_BLOCKS, block_size, kv_heads, head_dim, generator=gen) for _ in "kv"]
        q = torch.randn(3, heads, head_dim, generator=gen)
        k, v = (torch.randn(3, kv_heads, head_dim, generator=gen) for _ in "kv")
        want = ref.forward(q, k, v, *(c.clone() for c in cache), ref_meta, head_dim**-0.5)
        got = backend.forward(q, k, v, *cache, meta, head_dim**-0.5)
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32], msg=lambda m: f"layer {layer}: {m}")
        made.append(meta.split_buffers)
    assert made[0] is not None, "contexts of 70 and 100 over partitions of 32 must split"
    assert made[1] is made[0] and made[2] is made[0], "each layer made its own split-K buffers"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"block{s[0]}-gqa{s[1] // s[2]}")
def test_prefill_chunks_fresh_mid_block_and_block_aligned_match_torch(dtype, shape):
    block_size = shape[0]
    chunks = [(0, 21), (block_size + 3, 19), (2 * block_size, 9)]
    _compare(dtype, *shape, head_dim=64, decode_lens=[], chunks=chunks)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch_at_head_dim_128_matches_torch(dtype):
    _compare(dtype, 16, 8, 1, 128, decode_lens=[5, 40, 77], chunks=[(0, 12), (21, 30)], seed=3)


def test_group_that_is_not_a_power_of_two_matches_torch():
    # Six query heads over two KV heads, as in the built-in default model.
    _compare(torch.float32, 16, 6, 2, 64, decode_lens=[9, 50], chunks=[(5, 14)], seed=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_write_kernel_places_each_row_in_its_slot_exactly(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    shape = (12, block_size, 2, 64)
    k_cache = torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(12 * block_size, generator=gen)[:37].to(DEVICE)
    kv = torch.randn(37, 2, 2, 64, generator=gen).to(dtype).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, k, v, slots)
    triton_attention.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k), (
        "K rows landed somewhere else than the torch write puts them"
    )
    assert torch.equal(v_cache, want_v), (
        "V rows landed somewhere else than the torch write puts them"
    )


# ------------------------------------------------------------------ selection


def test_unknown_attention_backend_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_auto_is_triton_on_cuda_and_not_on_a_cpu():
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "torch"
    assert resolve_attention_backend("auto", "cpu") in ("cpu", "torch")  # cpu: the C kernel


def test_triton_backend_without_triton_says_what_to_install(monkeypatch):
    monkeypatch.setattr(triton_attention, "triton", None)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        TritonAttention(16, DEVICE, 64)


def test_triton_backend_on_cpu_outside_the_interpreter_asks_for_cuda(monkeypatch):
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        TritonAttention(16, "cpu", 64)


def test_triton_backend_rejects_a_head_dim_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="head_dim"):
        TritonAttention(16, DEVICE, 80)


# ------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model) -> str:
    return str(
        build_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", default_model, seed=5)
    )


def _greedy(model_dir: str, backend: str) -> list[list[int]]:
    # A 12-token budget splits the longer prompt into chunks that start mid-block.
    llm = LLM(
        model=model_dir, attention_backend=backend, device=str(DEVICE), num_kv_blocks=24,
        block_size=8, max_num_batched_tokens=12,
    )  # fmt: skip
    assert llm.engine.attention.name == backend
    prompts = [list(range(3, 40)), list(range(100, 109))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.stats().num_blocks_in_use == 0, f"{backend}: KV blocks leaked"
    return tokens


def test_engine_on_the_triton_backend_gives_the_torch_backends_greedy_tokens(tiny_llama):
    want, got = _greedy(tiny_llama, "torch"), _greedy(tiny_llama, "triton")
    assert got == want, f"triton backend gave {got}, torch backend {want}"
