"""GPU numbers for the Triton attention backend and the engine, measured in one run on
one device, in this order (the cheap, most telling ones first; the JSON and the profile
table are rewritten after each, so a run cut short keeps what it measured):

* ``copy``: a large device-to-device copy, bytes read plus written per second: the
  practical peak bandwidth, beside the datasheet's (by device name).
* ``decode``: the paged decode kernels (split-K plus reduce) on 64 requests of 4096
  tokens, 32 query heads over 8 KV heads, head_dim 128, bf16, 16-token blocks. The
  bytes they must read (every context token's K and V, plus q) and write (the output)
  over the kernel time (CUDA events, median) give the achieved bandwidth, against the
  copy's and the datasheet's. The same step through the torch backend (gather + SDPA)
  gives the speedup. Smaller batches and contexts go into the profile table.
* ``prefill``: the prefill kernel on fresh (causal) chunks, 8 of 2048 tokens at the same
  heads, in TFLOP/s (QK^T and PV: 4 x head_dim flops per query-key pair and head).
* ``sampling``: the sampler's seeded random draw against softmax + ``torch.multinomial``
  on the same logits, batches 8-128 over vocabularies of 32000 and 128256
  (``bench.sampling``).
* ``engine``: output tokens/s of ``LLM.generate`` on a random-weight Llama of about
  0.35B parameters (hidden 1024, 24 layers, 16 heads over 8 KV heads, intermediate
  2816, vocab 32000) in bf16, on the triton backend (steps replayed as CUDA graphs:
  whole for decodes, piecewise with prefill chunks), on it without graphs, and on the torch backend. The warm-up
  (Triton's first compiles) runs on other prompts, and prefix caching is off, so the
  timed run computes every prompt token.
* ``transfer``: 1P+1D on the one device: a prefill engine computes each prompt and hands
  its packed KV to a decode engine, which writes it into its reserved blocks
  (``remote_kv_arrived``) and decodes; hand-off bandwidth, and whether the tokens equal
  one engine's run of the same requests. No Ray (the GPU image has none): the engines'
  own hand-off, the part every transfer backend ends in.
* ``batching``: continuous against static batching on the same model, requests of mixed
  prompt and output lengths (``BATCHING``), generated offline by one engine in each
  mode: output tokens/s and their ratio. Where a step's time barely grows with its
  batch, as on a GPU, a static batch's seats left empty by its finished requests are
  what continuous batching wins back.
* ``steps``: the same model's engine steps timed one by one (``bench.steps``: decode at
  batches 1-128 and contexts 512 and 2048, whole-prompt prefills, decodes beside a
  prefill), as the simulator's step profile (``tandem-step-profile/1``, the format
  ``python -m bench.steps --profile`` writes on a CPU): the profile table carries it as
  ``step_profile``, and ``sim.cost`` fits the engine's per-step costs on this device
  from it.

The profile table (``--profile``) is what a simulator reads: one row per measured
operation and shape; its format is in docs/BENCHMARKS.md ("GPU profile table").

    python -m bench.gpu [--out bench-gpu.json] [--profile gpu-profile.json]
                        [--skip-engine] [--skip-transfer] [--skip-steps]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

# Datasheet HBM bandwidth in TB/s, matched against torch's device name in this order
# (more specific names first: "A100" also contains "A10", "L40S" contains "L4").
PEAK_TBPS = [
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),
    ("H20", 4.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
    ("L40", 0.864),
    ("L4", 0.3),
    ("A10G", 0.6),
    ("A10", 0.6),
    ("RTX 4090", 1.008),
    ("V100", 0.9),
]

HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
DECODE = dict(batch=64, context=4096, partition_size=512, **HEADS)
# Further decode shapes for the profile table (the headline one above is measured first).
DECODE_SWEEP = [(1, 1024), (1, 4096), (16, 1024), (16, 4096), (64, 1024)]
PREFILL = dict(chunks=8, chunk_len=2048, **HEADS)
PREFILL_SWEEP = [(1, 512), (8, 512), (1, 2048)]
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
PROFILE_FORMAT = "tandem-gpu-profile/1"


def table_peak_tbps(name: str) -> float | None:
    return next((tbps for key, tbps in PEAK_TBPS if key in name), None)


def time_ms(fn, iters: int, device: str = "cuda", warmup: int = 3) -> float:
    """Median time of ``fn`` in milliseconds, by CUDA events around each call. On CPU,
    where only the tests run these functions (small sizes, Triton's interpreter), one
    call by the clock."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile_row(op: str, dtype: str, params: dict, ms: float, throughput: float, unit: str) -> dict:
    """One row of the profile table (docs/BENCHMARKS.md, "GPU profile table")."""
    return {"op": op, "dtype": dtype, "params": params, "ms": ms, "throughput": throughput, "unit": unit}


def copy_bandwidth(nbytes: int = 2 << 30, device: str = "cuda") -> dict:
    """A large device-to-device copy: bytes read plus bytes written, per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=20, device=device)
    src = dst = None  # the 4 GiB go back before the next measurement
    tbps = 2 * nbytes / (ms * 1e-3) / 1e12
    return {"tbps": tbps, "row": profile_row("copy", "uint8", {"bytes": nbytes}, ms, tbps, "TB/s")}


def paged_layout(decode_lens: list[int], chunks: list[tuple[int, int]], block_size: int, seed: int):
    """A step on shuffled blocks: decode requests of ``decode_lens`` tokens (laid out
    shortest first, as the model runner lays them out), then prefill chunks of
    ``(start, num_tokens)``; returns the layout and the number of blocks it needs."""
    from engine.model.step_layout import StepLayout

    bs = block_size
    need = sum(-(-n // bs) for n in decode_lens) + sum(-(-(s + n) // bs) for s, n in chunks)
    free = list(range(1, need + 1))
    random.Random(seed).shuffle(free)
    return StepLayout.on_blocks(sorted(decode_lens), chunks, bs, free), need + 1


def paged_tensors(layout, num_blocks: int, shape: dict, dtype: torch.dtype, device, seed: int = 0):
    """Random caches, [blocks, block, Hkv, D] each, and this step's q, [k, v] for
    ``layout`` at ``shape``'s heads, drawn on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = len(layout.slots)
    hq, hkv, d, bs = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"], shape["block_size"]

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    caches = [rand(num_blocks, bs, hkv, d) for _ in range(2)]
    return caches, rand(rows, hq, d), [rand(rows, hkv, d) for _ in range(2)]


def bench_decode(
    copy_tbps: float, table_tbps: float | None, device: str = "cuda",
    shape: dict = DECODE, sweep: list[tuple[int, int]] = DECODE_SWEEP,
) -> dict:  # fmt: skip
    """The headline decode ``shape`` against the copy's bandwidth, then the ``sweep``'s
    (batch, context) pairs."""
    from engine.model.attention import TorchAttention
    from engine.model.triton_attention import TritonAttention, decode_attention

    def one(batch: int, context: int, torch_too: bool = False) -> dict:
        c = {**shape, "batch": batch, "context": context}
        layout, num_blocks = paged_layout([context] * batch, [], c["block_size"], seed=0)
        (k_cache, v_cache), q, (k, v) = paged_tensors(layout, num_blocks, c, torch.bfloat16, device)
        scale = c["head_dim"] ** -0.5
        backend = TritonAttention(c["block_size"], device, c["head_dim"], c["partition_size"])
        meta = backend.build_metadata(layout)
        out = torch.empty_like(q)

        def kernels() -> None:
            decode_attention(
                q, k_cache, v_cache, out, meta.decode_block_tables, meta.decode_context_lens,
                meta.max_decode_len, scale, backend.partition_size,
            )  # fmt: skip

        ms = time_ms(kernels, iters=50, device=device)
        elem = q.element_size()
        moved = 2 * batch * context * c["num_kv_heads"] * c["head_dim"] * elem + 2 * q.numel() * elem
        tbps = moved / (ms * 1e-3) / 1e12
        params = {**c, "partition_size": backend.partition_size}
        found = {"shape": {**params, "dtype": "bfloat16"}, "bytes_moved": moved, "kernel_ms": ms,
                 "achieved_tbps": tbps, "fraction_of_copy_peak": tbps / copy_tbps,
                 "fraction_of_table_peak": tbps / table_tbps if table_tbps else None,
                 "row": profile_row("decode_attention", "bfloat16", params, ms, tbps, "TB/s")}  # fmt: skip
        if torch_too:
            ref = TorchAttention(c["block_size"], torch.device(device))
            ref_meta = ref.build_metadata(layout)
            found["torch_backend_step_ms"] = time_ms(
                lambda: ref.forward(q, k, v, k_cache, v_cache, ref_meta, scale), 10, device
            )
            found["triton_backend_step_ms"] = time_ms(
                lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale), 50, device
            )
            found["speedup_vs_torch"] = found["torch_backend_step_ms"] / found["triton_backend_step_ms"]
        return found

    result = one(shape["batch"], shape["context"], torch_too=True)
    _empty_cache(device)
    result["sweep"] = [one(b, n)["row"] for b, n in sweep]
    return result


def causal_flops(chunk_len: int, num_heads: int, head_dim: int) -> int:
    """QK^T and PV of one fresh causal chunk: 2 x 2 x head_dim per query-key pair."""
    return 4 * head_dim * num_heads * chunk_len * (chunk_len + 1) // 2


def bench_prefill(
    device: str = "cuda", shape: dict = PREFILL, sweep: list[tuple[int, int]] = PREFILL_SWEEP
) -> dict:
    """Fresh chunks through the prefill kernel, in TFLOP/s: the headline ``shape``, then
    the ``sweep``'s (chunks, chunk_len) pairs."""
    from engine.model.triton_attention import TritonAttention, prefill_attention

    def one(chunks: int, chunk_len: int) -> dict:
        c = {**shape, "chunks": chunks, "chunk_len": chunk_len}
        layout, num_blocks = paged_layout([], [(0, chunk_len)] * chunks, c["block_size"], seed=0)
        (k_cache, v_cache), q, _ = paged_tensors(layout, num_blocks, c, torch.bfloat16, device)
        backend = TritonAttention(c["block_size"], device, c["head_dim"])
        meta = backend.build_metadata(layout)
        out = torch.empty_like(q)
        scale = c["head_dim"] ** -0.5

        def kernel() -> None:
            prefill_attention(
                q, k_cache, v_cache, out, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_context_start, meta.max_chunk_len, scale,
            )  # fmt: skip

        ms = time_ms(kernel, iters=20, device=device)
        flops = chunks * causal_flops(chunk_len, c["num_heads"], c["head_dim"])
        tflops = flops / (ms * 1e-3) / 1e12
        row = profile_row("prefill_attention", "bfloat16", c, ms, tflops, "TFLOP/s")
        return {"shape": {**c, "dtype": "bfloat16"}, "flops": flops, "kernel_ms": ms,
                "achieved_tflops": tflops, "row": row}  # fmt: skip

    result = one(shape["chunks"], shape["chunk_len"])
    _empty_cache(device)
    result["sweep"] = [one(n, length)["row"] for n, length in sweep]
    return result


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
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
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
        _sync(device)
        t0 = time.perf_counter()
        first = decode.remote_kv_arrived(rid, firsts[rid].token_ids[0], k, v)
        _sync(device)
        seconds += time.perf_counter() - t0
        tokens[rid] += first.new_token_ids
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens[o.request_id] += o.new_token_ids
    return {"tokens": [tokens[rid] for rid in ids], "kv_bytes": nbytes, "handoff_s": seconds}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


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
    _empty_cache(device)
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


def bench_checksums(size_mib: int = 256, device: str = "cuda") -> dict:
    """Per-block KV checksums (``transfer.checksums``) of ``size_mib`` of bf16 KV in a
    paged cache twice that size, in one stretch and in scattered blocks: what a sender
    or a receiver adds to a transfer of that size (the sums come back to the host)."""
    import random

    from kv_transfer.checksum import block_checksums

    layers, block_size, heads, head_dim = 16, 16, 8, 128
    block_bytes = 2 * layers * block_size * heads * head_dim * 2  # K and V, bf16
    blocks = max(1, (size_mib << 20) // block_bytes)
    k, v = (torch.randn(layers, 2 * blocks, block_size, heads, head_dim, device=device, dtype=torch.bfloat16)
            for _ in range(2))  # fmt: skip
    stretch = list(range(blocks))
    scattered = random.Random(0).sample(range(2 * blocks), blocks)
    ms = {name: time_ms(lambda ids=ids: block_checksums(k, v, ids), iters=10, device=device)
          for name, ids in (("contiguous", stretch), ("scattered", scattered))}  # fmt: skip
    nbytes = blocks * block_bytes
    gbps = {name: nbytes / (t * 1e-3) / 1e9 for name, t in ms.items()}
    shape = {"bytes": nbytes, "blocks": blocks, "layers": layers, "block_size": block_size,
             "num_kv_heads": heads, "head_dim": head_dim}  # fmt: skip
    return {
        "bytes": nbytes,
        "ms": ms,
        "gbps": gbps,
        "row": profile_row("kv_block_checksums_scattered", "bfloat16", shape, ms["scattered"], gbps["scattered"],
                           "GB/s"),  # fmt: skip
    }


def profile_table(result: dict) -> dict:
    """The profile table of what ``result`` holds so far."""
    rows = [result["copy"]["row"]] if "copy" in result else []
    for section in ("decode", "prefill"):
        if section in result:
            rows += [result[section]["row"], *result[section]["sweep"]]
    engine = result.get("engine")
    if engine:
        model = {**engine["model"], **engine["workload"]}
        rows += [profile_row(f"engine_generate_{b}", "bfloat16", model,
                             engine[b]["seconds"] * 1e3, engine[b]["output_tokens_per_s"], "tokens/s")
                 for b in ("triton", "triton_eager", "torch") if b in engine]  # fmt: skip
    if "transfer" in result:
        rows.append(result["transfer"]["row"])
    if "checksums" in result:
        rows.append(result["checksums"]["row"])
    table = {"format": PROFILE_FORMAT, "device": result["device"], "versions": result["versions"], "rows": rows}
    if "steps" in result:
        table["step_profile"] = result["steps"]
    return table


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
        _empty_cache(device)
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


DECODE_BAR = 0.7  # the decode kernel's share of the copy bandwidth a good run reaches


def run(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """Every measurement in order, ``save``-ing the result after each. A measurement that
    raises is recorded under "errors" (its traceback printed) and the next one runs: on a
    one-off GPU lease, a failing engine run must not cost the transfer's numbers."""
    import triton

    name = torch.cuda.get_device_name()
    result: dict = {
        "device": name,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "table_peak_tbps": table_peak_tbps(name),
        "errors": {},
    }

    def measure(section: str, fn: Callable[[], dict]) -> None:
        try:
            result[section] = fn()
        except Exception:  # noqa: BLE001 -- recorded and printed, the next section runs
            result["errors"][section] = traceback.format_exc()
            print(f"bench.gpu: {section} failed\n{result['errors'][section]}", flush=True)
        torch.cuda.empty_cache()
        save(result)

    measure("copy", copy_bandwidth)
    copy_tbps = result.get("copy", {}).get("tbps")
    if copy_tbps:
        measure("decode", lambda: bench_decode(copy_tbps, result["table_peak_tbps"]))
    measure("prefill", bench_prefill)
    measure("sampling", bench_sampling)
    if args.skip_engine and args.skip_transfer and args.skip_steps:
        return result
    workload = dict(num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len)
    with tempfile.TemporaryDirectory(prefix="tandem-llama-05b-") as tmp:
        model_dir = build_llama_05b(Path(tmp) / "llama-0.35b", torch.bfloat16)
        if not args.skip_engine:
            measure("engine", lambda: engine_section(model_dir, workload))
        if not args.skip_transfer:
            measure("transfer", lambda: bench_transfer(model_dir, **TRANSFER))
            measure("checksums", bench_checksums)
        if not args.skip_engine:
            measure("batching", lambda: bench_batching(model_dir, **BATCHING))
        if not args.skip_steps:
            measure("steps", lambda: bench_steps(model_dir))
    return result


def bench_sampling(batches=(8, 32, 128), vocabs=(32000, 128256), device: str = "cuda") -> dict:
    """The sampler's random draw (one batched inverse-CDF draw, seeded per request) against
    softmax + ``torch.multinomial`` on the same logits (``bench.sampling``)."""
    from bench.sampling import measure as measure_draw

    return {"rows": [measure_draw(b, v, device, repeat=10) for v in vocabs for b in batches]}


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


def saver(out: Path, profile: Path | None) -> Callable[[dict], None]:
    """Writes the result (and its profile table) whole, replacing the last copy."""

    def save(result: dict) -> None:
        for path, data in ((out, result), (profile, profile_table(result) if profile else None)):
            if path is None:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=2) + "\n")
            tmp.replace(path)
        saved = [k for k in result if k not in ("device", "versions", "errors")]
        print(f"bench.gpu: saved {', '.join(saved)}", flush=True)

    return save


def summary(result: dict) -> dict:
    """The headline numbers, for the log."""
    def get(*keys):
        value = result
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        return value

    return {
        "device": result["device"],
        "copy_tbps": get("copy", "tbps"),
        "decode_tbps": get("decode", "achieved_tbps"),
        "decode_fraction_of_copy": get("decode", "fraction_of_copy_peak"),
        f"decode_at_least_{DECODE_BAR:.0%}_of_copy": (get("decode", "fraction_of_copy_peak") or 0) >= DECODE_BAR,
        "decode_speedup_vs_torch": get("decode", "speedup_vs_torch"),
        "prefill_tflops": get("prefill", "achieved_tflops"),
        "sampling_vs_multinomial": [round(r["ratio_vs_multinomial"], 2) for r in get("sampling", "rows") or []],
        "engine_tokens_per_s": get("engine", "triton", "output_tokens_per_s"),
        "engine_speedup_vs_torch": get("engine", "speedup_vs_torch"),
        "engine_graphs_speedup": get("engine", "graphs_speedup"),
        "continuous_over_static": get("batching", "continuous_over_static"),
        "handoff_gbps": get("transfer", "handoff_gbps"),
        "handoff_requests_equal_to_one_engine": get("transfer", "requests_equal_to_one_engine"),
        "checksums_gbps_scattered": get("checksums", "gbps", "scattered"),
        "step_profile_rows": len(get("steps", "rows") or []),
        "failed": sorted(result["errors"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=Path("bench-gpu.json"), help="the JSON results")
    ap.add_argument("--profile", type=Path, help="also write the profile table here")
    ap.add_argument("--skip-engine", action="store_true", help="no engine tokens/s")
    ap.add_argument("--skip-transfer", action="store_true", help="no 1P+1D hand-off")
    ap.add_argument("--skip-steps", action="store_true", help="no engine step profile")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024, help="> 512: decode splits contexts")
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (torch.cuda.is_available() is False)")
    result = run(args, saver(args.out, args.profile))
    print(json.dumps(summary(result), indent=2))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
