"""Tensor parallelism within one worker (``engine.model.parallel``): a model sharded over two
ranks computes what the one-rank model computes on the same checkpoint, and each rank holds
and reads only its slices.

The two ranks are two threads of the test process over one gloo group (rank 0 hosts the
rendezvous store on a free port). Each rank loads its slices, prefills a prompt and decodes
greedily through its own paged KV cache and the CPU attention backend; its hidden states and
logits must equal the one-rank model's to float32 rounding, and its tokens exactly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from engine.model.attention import StepAttention, create_attention_backend
from engine.model.kv_cache import KVCache, bytes_per_block
from engine.model.loader import load_model
from engine.model.model import DecoderModel, PackedRowParallel, RowParallelLinear
from engine.model.model_config import ModelConfig
from engine.model.parallel import GlooGroup, Shard, TPGroup, shard_of
from engine.model.step_layout import ChunkLayout, StepLayout, decode_table
from tests.helpers import build_gguf, build_hf_checkpoint

BLOCK = 4
PROMPT_LEN = 40  # past Gemma 3's window of 32: its sliding layers drop keys
DECODE_STEPS = 4
RANK_TIMEOUT_S = 120

# The families, as tests.helpers builds them, with what sets each apart under sharding.
FAMILIES = {
    "llama_gqa": ("llama", {}),  # 4 query heads over 2 KV heads: one KV head per rank
    "llama_one_kv_head": ("llama", dict(num_key_value_heads=1)),  # the KV head on both ranks
    "llama_odd_vocab": ("llama", dict(vocab_size=4097)),  # rank 1's last row is padding
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),  # o and down biases: once
    "qwen2": ("qwen2", {}),  # q/k/v bias, tied embeddings, one KV head
    "qwen3_moe": ("qwen3_moe", {}),  # experts sharded, q/k norms, a dense layer between
    "mixtral": ("mixtral", {}),
    "gemma3": ("gemma3", {}),  # sandwich norms, embed scale, sliding windows
    "phi3": ("phi3", {}),  # fused q/k/v and gate/up in the checkpoint, partial rotary
}


@dataclass(frozen=True)
class LoadOnly:
    """Rank ``rank`` of ``size`` for building and loading a model, which run no collective."""

    rank: int
    size: int

    def all_reduce(self, tensor):
        raise AssertionError("building or loading a model runs no collective")

    all_gather = broadcast_object = all_reduce

    def close(self) -> None:
        pass


def on_two_ranks(work: Callable[[TPGroup], object]) -> list:
    """``work`` run by ranks 0 and 1 at once (two threads, one gloo group): their results."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: list = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        rank_store = store if r == 0 else TCPStore("127.0.0.1", store.port, is_master=False)
        group = GlooGroup(rank_store, r, 2, prefix="test", timeout_s=RANK_TIMEOUT_S / 2)
        try:
            results[r] = work(group)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)
        finally:
            group.close()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RANK_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), f"a rank still runs after {RANK_TIMEOUT_S} s"
    if errors:
        raise errors[0]
    return results


@dataclass
class Run:
    """What a greedy run gave: the prefill's hidden states, each step's logits, the tokens."""

    hidden: torch.Tensor
    logits: list[torch.Tensor]
    tokens: list[int]


def greedy(model: DecoderModel, prompt: list[int], steps: int, backend: str = "auto") -> Run:
    """Prefill ``prompt`` in one chunk, then ``steps`` greedy decode steps, through a paged
    KV cache of the model's shard and the engine's attention backend."""
    config = model.config
    num_blocks = -(-(len(prompt) + steps) // BLOCK) + 1
    cache = KVCache(config, num_blocks, BLOCK, torch.float32, tp=shard_of(model.tp))
    attention = create_attention_backend(backend, "cpu", BLOCK, config.head_dim)
    table = list(range(1, num_blocks))  # block 0 stays the padding block

    def slot(p: int) -> int:
        return table[p // BLOCK] * BLOCK + p % BLOCK

    def forward(ids: list[int], start: int, layout: StepLayout) -> torch.Tensor:
        attn = StepAttention(attention, attention.build_metadata(layout))
        positions = torch.arange(start, start + len(ids))
        return model(torch.tensor(ids), positions, cache.k, cache.v, attn)

    tokens = list(prompt)
    with torch.inference_mode():
        n = len(prompt)
        layout = StepLayout([slot(p) for p in range(n)], [], [ChunkLayout(0, n, 0, table[: -(-n // BLOCK)])])
        hidden = forward(tokens, 0, layout)
        logits = [model.logits(hidden[-1:])]
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax(-1)))
            ctx = len(tokens)
            rows = decode_table([table[: -(-ctx // BLOCK)]], [ctx], BLOCK)
            layout = StepLayout([slot(ctx - 1)], [ctx], [], rows)
            logits.append(model.logits(forward(tokens[-1:], ctx - 1, layout)))
    return Run(hidden, logits, tokens[len(prompt) :])


def prompt_for(vocab_size: int) -> list[int]:
    """Ids from both ends of the vocabulary (each rank's embedding rows), the last one included."""
    rng = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab_size, (PROMPT_LEN,), generator=rng).tolist()
    ids[:3] = [vocab_size - 1, 0, vocab_size // 2]
    return ids


def assert_same_run(got: Run, want: Run, what: str) -> None:
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what} hidden: {m}")
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        assert g.shape == w.shape, f"{what}: step {step}'s logits are {tuple(g.shape)}, expected {tuple(w.shape)}"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what} step {step} logits: {m}")
    assert got.tokens == want.tokens, f"{what}: greedy tokens {got.tokens}, expected {want.tokens}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model):
    """Each family's checkpoint, built on first use."""
    built: dict = {}

    def get(name: str):
        if name not in built:
            family, overrides = FAMILIES[name]
            built[name] = build_hf_checkpoint(tmp_path_factory.mktemp(name), family, default_model, seed=11, **overrides)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_ranks_compute_what_one_rank_computes(checkpoints, name):
    ckpt = checkpoints(name)
    one = load_model(ckpt)
    prompt = prompt_for(one.config.vocab_size)
    want = greedy(one, prompt, DECODE_STEPS)
    ranks = on_two_ranks(lambda group: greedy(load_model(ckpt, tp=group), prompt, DECODE_STEPS))
    for rank, got in enumerate(ranks):
        assert_same_run(got, want, f"{name} rank {rank} of 2")
    assert want.logits[0].shape == (1, one.config.vocab_size)


@pytest.mark.parametrize("pack,backend", [(False, "torch"), (True, "torch")])
def test_plain_and_packed_projections_and_the_reference_backend_shard_alike(checkpoints, pack, backend):
    ckpt = checkpoints("llama_biases")
    prompt = prompt_for(ModelConfig.from_pretrained(ckpt).vocab_size)
    want = greedy(load_model(ckpt, pack=pack), prompt, DECODE_STEPS, backend)

    def rank(group):
        model = load_model(ckpt, pack=pack, tp=group)
        row_parallel = PackedRowParallel if pack else RowParallelLinear
        assert type(model.layers[0].self_attn.o_proj) is row_parallel
        return greedy(model, prompt, DECODE_STEPS, backend)

    for r, got in enumerate(on_two_ranks(rank)):
        assert_same_run(got, want, f"pack={pack} rank {r}")


def test_one_rank_builds_the_plain_modules_and_runs_no_collective(default_model):
    model = load_model(default_model, tp=LoadOnly(0, 1))  # a collective would raise
    assert not any(isinstance(m, RowParallelLinear | PackedRowParallel) for m in model.modules())
    assert type(model.embed_tokens) is torch.nn.Embedding
    greedy(model, prompt_for(model.config.vocab_size), 2)


def test_a_rank_of_two_holds_about_half_the_weights(default_model):
    one = load_model(default_model).weight_bytes()
    ranks = [load_model(default_model, tp=LoadOnly(r, 2)).weight_bytes() for r in range(2)]
    ratio = max(ranks) / one
    print(f"\nweight bytes: TP1 {one}, TP2 ranks {ranks}: {ratio:.3f} of TP1 per rank")
    assert ratio <= 0.55, f"a rank of two holds {ratio:.1%} of the one-rank model's weight bytes"
    assert sum(ranks) >= one, "between them the ranks hold every weight"


class CountingFiles:
    """``safe_open`` wrapped to record each read: (tensor name, elements read, whole or not)."""

    def __init__(self, real_open) -> None:
        self.real_open = real_open
        self.reads: list[tuple[str, int, bool]] = []

    def __call__(self, path, framework):
        return _CountingFile(self.real_open(path, framework=framework), self.reads)


class _CountingFile:
    def __init__(self, real, reads) -> None:
        self.real, self.reads = real, reads

    def __enter__(self):
        self.f = self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.reads.append((name, t.numel(), True))
        return t

    def get_slice(self, name):
        return _CountingSlice(self.f.get_slice(name), name, self.reads)


class _CountingSlice:
    def __init__(self, real, name, reads) -> None:
        self.real, self.name, self.reads = real, name, reads

    def get_shape(self):
        return self.real.get_shape()

    def __getitem__(self, index):
        t = self.real[index]
        self.reads.append((self.name, t.numel(), False))
        return t


def test_a_rank_reads_only_its_slices_of_the_checkpoint(monkeypatch, default_model):
    from safetensors.torch import load_file

    import engine.model.loader as loader

    total = sum(t.numel() for t in load_file(default_model / "model.safetensors").values())
    counting = CountingFiles(loader.safe_open)
    monkeypatch.setattr(loader, "safe_open", counting)
    load_model(default_model, tp=LoadOnly(0, 1))
    assert sum(n for _, n, _ in counting.reads) == total, "one rank reads every tensor once"
    for rank in range(2):
        counting.reads.clear()
        load_model(default_model, tp=LoadOnly(rank, 2))
        read = sum(n for _, n, _ in counting.reads)
        whole = sorted({name for name, _, is_whole in counting.reads if is_whole})
        assert all(name.endswith("norm.weight") for name in whole), f"rank {rank} read whole: {whole}"
        assert read <= 0.51 * total, f"rank {rank} of 2 read {read} of the checkpoint's {total} elements"


def test_heads_that_do_not_split_over_the_ranks_are_refused_naming_the_limit(default_model):
    config = ModelConfig.from_pretrained(default_model)  # 6 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must divide by tensor_parallel_size \(4\)"):
        load_model(default_model, tp=LoadOnly(0, 4))
    odd_kv = dataclasses.replace(config, num_kv_heads=3)
    with torch.device("meta"), pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide by .* \(2\)"):
        DecoderModel(odd_kv, LoadOnly(0, 2))
    with torch.device("meta"), pytest.raises(ValueError, match=r"intermediate_size \(1023\) must divide"):
        DecoderModel(dataclasses.replace(config, intermediate_size=1023), LoadOnly(0, 2))


def test_a_ranks_kv_cache_holds_its_kv_heads_only(default_model):
    config = ModelConfig.from_pretrained(default_model)  # 2 KV heads
    f32 = torch.float32
    assert KVCache(config, 3, BLOCK, f32, tp=Shard(1, 2)).k.shape[3] == 1
    assert KVCache(config, 3, BLOCK, f32).k.shape[3] == 2
    assert 2 * bytes_per_block(config, BLOCK, f32, tp_size=2) == bytes_per_block(config, BLOCK, f32)
    one_head = dataclasses.replace(config, num_kv_heads=1)  # replicated: each rank holds it
    assert KVCache(one_head, 3, BLOCK, f32, tp=Shard(1, 2)).v.shape[3] == 1
    assert bytes_per_block(one_head, BLOCK, f32, tp_size=2) == bytes_per_block(one_head, BLOCK, f32)


# llama: Q/K rows permuted in the file; phi3: q/k/v and gate/up fused; qwen3_moe: experts stacked.
GGUF_FAMILIES = {"llama": {}, "phi3": {}, "qwen3_moe": dict(mlp_only_layers=[])}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_a_gguf_file_gives_each_rank_the_slices_its_checkpoint_gives(tmp_path, default_model, family):
    pytest.importorskip("gguf")
    hf_dir = build_hf_checkpoint(tmp_path / "hf", family, default_model, seed=9, **GGUF_FAMILIES[family])
    path = build_gguf(tmp_path / f"{family}.gguf", hf_dir)
    for rank in range(2):
        ours = load_model(path, pack=False, tp=LoadOnly(rank, 2))
        want = dict(load_model(hf_dir, pack=False, tp=LoadOnly(rank, 2)).named_parameters())
        for name, param in ours.named_parameters():
            assert torch.equal(param, want[name]), f"rank {rank}: {name}"
