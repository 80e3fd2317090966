"""The GPU benchmark's measurements of the engine on a random-weight Llama of about 0.35B
parameters (``LLAMA_05B``): output tokens/s of ``LLM.generate`` per backend, the 1P+1D
hand-off between two engines on one device, continuous against static batching, and the
engine's step profile.

``bench/gpu.py`` is the program that runs them after ``bench/gpu_kernels.py``'s (whose
timing helpers and profile rows these use) and writes the results; its docstring says what
each measures.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import torch

from bench.gpu_kernels import empty_device_cache, profile_row, sync_device

LLAMA_05B = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=2816,
    vocab_size=32000,
    max_position_embeddings=4096,
)
TRANSFER = dict(num_requests=16, prompt_len=2048, output_len=16)


def build_llama_05b(out_dir: Path, dtype: torch.dtype) -> Path:
    """A random-weight Llama checkpoint with the built-in model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.default_model import ensure_default_model

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_05B, bos_token_id=None, eos_token_id=None)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out_dir)
    tokenizer_dir = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def engine_settings(
    backend: str, num_requests: int, kv_cache_memory: int = 16 << 30, device: str = "cuda"
) -> dict:
    """The benchmarked engine: prefix caching off, so the warm-up cannot shorten the run."""
    return dict(
        device=device, dtype="bfloat16", attention_backend=backend,
        kv_cache_memory=kv_cache_memory, max_num_seqs=num_requests, enable_prefix_caching=False,
    )  # fmt: skip


def bench_prompts(
    num_requests: int, prompt_len: int, vocab: int, warmup_requests: int = 16
) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts, timed prompts), drawn apart: the timed run computes every token."""
    rng = random.Random(0)
    timed = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_requests)]
    warmup = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(warmup_requests)]
    return warmup, timed


def bench_engine(
    model_dir: Path, backend: str, num_requests: int, prompt_len: int, output_len: int, **settings
) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), **{**engine_settings(backend, num_requests), **settings})
    # As many warm-up requests as timed ones: the timed batch's CUDA graph is captured then.
    warmup, prompts = bench_prompts(num_requests, prompt_len, LLAMA_05B["vocab_size"], warmup_requests=num_requests)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up: Triton compiles a kernel per specialization (split or not, strides divisible
    # by 16 or not), which a few steps over growing contexts all meet.
    llm.generate(warmup, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    return timed_generate(llm, prompts, params)


def timed_generate(llm, prompts, params, device: str = "cuda") -> dict:
    """One ``generate`` timed between device synchronizations: seconds and output tokens/s."""
    sync_device(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync_device(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}


def handoff(prefill, decode, prompts, params, device: str) -> dict:
    """1P+1D between two engines in this process: ``prefill`` computes each prompt and
    samples its first token, ``decode`` writes the packed KV into its reserved blocks and
    decodes the rest. Returns the decode engine's tokens, the KV bytes and the seconds
    spent writing them."""
    from engine import SamplingParams

    first_params = SamplingParams(**{**vars(params), "max_tokens": 1})
    ids = [prefill.add_request(p, first_params, hold_kv=True) for p in prompts]
    firsts = {}
    while prefill.has_unfinished_requests():
        firsts.update((o.request_id, o) for o in prefill.step() if o.finished)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    nbytes, seconds = 0, 0.0
    for rid, prompt in zip(ids, prompts):
        if decode.add_remote_request(prompt, params, request_id=rid) is None:
            raise RuntimeError(f"the decode engine has no room for request {rid}")
        k, v = prefill.take_held_kv(rid, firsts[rid].kv_blocks)
        nbytes += k.nbytes + v.nbytes
        sync_device(device)
        t0 = time.perf_counter()
        first = decode.remote_kv_arrived(rid, firsts[rid].token_ids[0], k, v)
        sync_device(device)
        seconds += time.perf_counter() - t0
        tokens[rid] += first.new_token_ids
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens[o.request_id] += o.new_token_ids
    return {"tokens": [tokens[rid] for rid in ids], "kv_bytes": nbytes, "handoff_s": seconds}


def bench_transfer(
    model_dir: Path, num_requests: int, prompt_len: int, output_len: int, device: str = "cuda",
    **settings,
) -> dict:  # fmt: skip
    """1P+1D on one device (``handoff``), checked against one engine's run; ``settings``
    override the engines' (``engine_settings``)."""
    from engine import LLM, LLMEngine, SamplingParams
    from engine.model.model_config import ModelConfig

    m = ModelConfig.from_pretrained(model_dir)
    settings = {**engine_settings("triton", num_requests, 4 << 30, device), **settings}
    prefill, decode = LLMEngine(model=str(model_dir), **settings), LLMEngine(model=str(model_dir), **settings)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    warmup, prompts = bench_prompts(num_requests, prompt_len, m.vocab_size, warmup_requests=2)
    handoff(prefill, decode, warmup, params, device)  # first compiles, first allocations
    found = handoff(prefill, decode, prompts, params, device)
    del prefill, decode
    empty_device_cache(device)
    alone = LLM(model=str(model_dir), **settings).generate(prompts, params)
    # bf16 in another batch composition may break a near-tie the other way: a share, not a
    # pass/fail (tests/unit/test_bench_gpu.py checks the hand-off itself in fp32).
    same = sum(a == o.token_ids for a, o in zip(found["tokens"], alone))
    gbps = found["kv_bytes"] / found["handoff_s"] / 1e9
    shape = {"requests": num_requests, "prompt_len": prompt_len, "layers": m.num_layers,
             "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "block_size": 16}  # fmt: skip
    return {
        "workload": {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len},
        "kv_bytes": found["kv_bytes"],
        "handoff_s": found["handoff_s"],
        "handoff_gbps": gbps,
        "requests_equal_to_one_engine": same,
        "row": profile_row("kv_handoff", "bfloat16", shape, found["handoff_s"] * 1e3 / num_requests,
                           gbps, "GB/s"),  # fmt: skip
    }


BATCHING = dict(num_requests=128, max_num_seqs=32, prompt_lens=(64, 256), output_lens=(16, 256))


def bench_batching(
    model_dir: Path, device: str = "cuda", num_requests: int = 128, max_num_seqs: int = 32,
    prompt_lens: tuple[int, int] = (64, 256), output_lens: tuple[int, int] = (16, 256), warmup_tokens: int = 16,
    **settings,
) -> dict:  # fmt: skip
    """Output tokens/s of continuous and of static batching on the same requests, prompt
    and output lengths drawn uniformly from ``prompt_lens`` and ``output_lens``."""
    from engine import LLM, SamplingParams
    from engine.model.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(*output_lens), temperature=0.0, ignore_eos=True)
              for _ in range(num_requests)]  # fmt: skip
    warmup = [[rng.randrange(vocab) for _ in range(prompt_lens[0])] for _ in range(max_num_seqs)]
    runs = {}
    for mode in ("continuous", "static"):
        llm = LLM(model=str(model_dir), **{**engine_settings("triton", max_num_seqs, 4 << 30, device),
                                          "batching": mode, **settings})  # fmt: skip
        llm.generate(warmup, SamplingParams(max_tokens=warmup_tokens, temperature=0.0, ignore_eos=True))
        runs[mode] = timed_generate(llm, prompts, params, device)
        del llm
        empty_device_cache(device)
    return {
        "workload": {"num_requests": num_requests, "max_num_seqs": max_num_seqs, "prompt_lens": list(prompt_lens),
                     "output_lens": list(output_lens)},  # fmt: skip
        **runs,
        "continuous_over_static": runs["continuous"]["output_tokens_per_s"] / runs["static"]["output_tokens_per_s"],
    }


STEPS = dict(batches=(1, 8, 32, 64, 128), contexts=(512, 2048), steps=20, prefill_lengths=(128, 512, 2048),
             mixed_batches=(4, 16), mixed_lengths=(64, 256))


def bench_steps(model_dir: Path, device: str = "cuda", shape: dict = STEPS) -> dict:
    """The engine's steps on ``model_dir``, timed one by one at ``shape``: a step profile."""
    from bench.common import device_kind
    from bench.steps import decode_kv_blocks, measure_profile, profile_table
    from engine import LLMEngine

    longest = max(*shape["contexts"], 128)  # mixed_times decodes at 128
    seats = max(*shape["batches"], *shape["mixed_batches"]) + 4  # + the prompts a prefill step computes
    engine = LLMEngine(model=str(model_dir), device=device, dtype="bfloat16", attention_backend="triton",
                       num_kv_blocks=decode_kv_blocks(seats, longest), max_num_seqs=seats)  # fmt: skip
    rows = measure_profile(engine, **shape)
    if engine.stats().num_blocks_in_use:
        raise RuntimeError(f"{engine.stats().num_blocks_in_use} KV blocks still in use after the step profile")
    return profile_table(engine, device_kind(device), Path(model_dir).name, rows)


def engine_section(model_dir: Path, workload: dict) -> dict:
    """Engine tokens/s on the triton backend (steps as CUDA graphs), on it without
    graphs (``triton_eager``) and on the torch backend, and the ratios."""
    runs = {
        "triton": bench_engine(model_dir, "triton", **workload),
        "triton_eager": bench_engine(model_dir, "triton", **workload, cuda_graphs=False),
        "torch": bench_engine(model_dir, "torch", **workload),
    }
    rate = {name: run["output_tokens_per_s"] for name, run in runs.items()}
    return {
        "model": {**LLAMA_05B, "dtype": "bfloat16"},
        "workload": workload,
        **runs,
        "speedup_vs_torch": rate["triton"] / rate["torch"],
        "graphs_speedup": rate["triton"] / rate["triton_eager"],
    }
