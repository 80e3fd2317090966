"""The CPU attention backend's C kernel agrees with the torch reference backend.

Each case builds one step at random (ragged contexts, shuffled blocks, decode rows and
prefill chunks), runs it through both backends' ``forward`` on copies of one cache, and
compares the outputs and the written caches. The kernel is built here as the engine
builds it (the machine's C compiler, cached under the test's ``TANDEM_HOME``).
"""

import random
import re

import pytest
import torch

from engine.model import cpu_attention
from engine.model.attention import TorchAttention, create_attention_backend, resolve_attention_backend
from engine.model.cpu_attention import CpuAttention, KernelUnavailable
from tests.helpers import random_step_layout

NUM_BLOCKS = 160
CPU = torch.device("cpu")


def _compare(block_size, num_heads, num_kv_heads, head_dim, decode_lens, chunks=(), seed=0, threads=None):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout = random_step_layout(block_size, decode_lens, list(chunks), rng, NUM_BLOCKS)
    rows = len(layout.slots)
    cache_shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(*cache_shape, generator=gen), torch.randn(*cache_shape, generator=gen)
    # Q, K and V as the model makes them: views into one fused projection, not contiguous.
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(rows, num_heads, head_dim), k.view(rows, num_kv_heads, head_dim), v.view(rows, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    ref = TorchAttention(block_size, CPU)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = ref.forward(q, k, v, ref_k, ref_v, ref.build_metadata(layout), scale)
    backend = CpuAttention(block_size, CPU)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        got = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout), scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "caches differ after the K/V write"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    return got


# (block size, query heads, KV heads, head dim): GQA ratios 1, 3 (SmolLM2), 7 (Qwen2-0.5B), 8.
SHAPES = [(16, 4, 4, 64), (16, 9, 3, 64), (8, 14, 2, 64), (32, 8, 1, 128), (4, 2, 1, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"block{s[0]}-gqa{s[1] // s[2]}-d{s[3]}")
def test_decode_rows_over_ragged_contexts_match_torch(shape):
    # Lengths of one token, a block's worth, one past, and many blocks.
    block = shape[0]
    _compare(*shape, decode_lens=sorted([1, 2, block, block + 1, 3 * block + 5, 97, 150]))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_mixed_step_of_decodes_and_chunks_matches_torch_on_any_thread_count(threads):
    # Chunks from the start (plain causal) and after cached blocks (masked): the torch path.
    _compare(16, 9, 3, 64, decode_lens=[5, 40, 130], chunks=[(0, 12), (33, 20)], seed=3, threads=threads)


def test_a_step_without_decode_rows_runs_chunks_only():
    _compare(16, 8, 2, 32, decode_lens=[], chunks=[(0, 30)])


def test_each_row_sees_only_its_own_blocks():
    # Identical queries over different blocks must give different outputs; a kernel that
    # read a neighbour's table (or a fixed one) would make rows equal.
    got = _compare(16, 4, 2, 32, decode_lens=[40, 40, 40, 40], seed=7)
    assert not torch.allclose(got[0], got[1])


def test_a_context_longer_than_its_block_table_is_an_error_not_a_wild_read():
    backend = CpuAttention(16, CPU)
    layout = random_step_layout(16, [20], [], random.Random(0), NUM_BLOCKS)
    meta = backend.build_metadata(layout)
    meta.paged_decode.context_lens[0] = 33  # two blocks in its table, 33 keys claimed
    cache = torch.zeros(NUM_BLOCKS, 16, 1, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="context length outside its block table"):
        backend.forward(q, q[:, :1], q[:, :1], cache, cache.clone(), meta, 1.0)


def test_auto_picks_the_kernel_for_float32_on_a_cpu_and_torch_otherwise():
    assert resolve_attention_backend("auto", "cpu", torch.float32) == "cpu"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "torch"
    assert create_attention_backend("auto", "cpu", 16, 64).name == "cpu"
    with pytest.raises(ValueError, match="float32"):
        create_attention_backend("cpu", "cpu", 16, 64, torch.bfloat16)


def test_without_a_compiler_auto_falls_back_to_torch_and_cpu_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_attention.load_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert create_attention_backend("auto", "cpu", 16, 64).name == "torch"
        assert "no-such-cc" in caplog.text
        with pytest.raises(KernelUnavailable, match=re.escape(str(tmp_path / "no-such-cc"))):
            create_attention_backend("cpu", "cpu", 16, 64)
    finally:
        cpu_attention.load_kernel.cache_clear()


def test_bench_steps_times_the_kernel_against_torch_attention(default_model, capsys):
    import json

    from bench.steps import main

    assert main(["--model", str(default_model), "--batches", "3", "--steps", "2", "--context", "20",
                 "--baseline", "torch-attention"]) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["step_ms"] > 0 and row["torch-attention_step_ms"] > 0


def test_tensors_the_kernel_cannot_read_are_refused_before_it_reads_them():
    from engine.model.cpu_attention import PagedDecode, paged_decode

    cache = torch.zeros(4, 16, 2, 8)
    rows = PagedDecode(block_tables=torch.tensor([[1]]), context_lens=torch.tensor([3]))
    q, out = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode(q, cache.transpose(1, 2), cache, rows, 1.0, out)
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        paged_decode(q, cache.bfloat16(), cache, rows, 1.0, out)
    paged_decode(q, cache, cache, rows, 1.0, out)  # the same call on contiguous float32 tensors runs
