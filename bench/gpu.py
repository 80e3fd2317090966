"""GPU numbers for the Triton attention backend, measured in one run on one device.

* ``decode``: the paged decode kernels (split-K plus reduce) on 64 requests of 4096
  tokens, 32 query heads over 8 KV heads, head_dim 128, bf16, 16-token blocks. The
  bytes they must read (every context token's K and V, plus q) and write (the output)
  over the kernel time (CUDA events, median) give the achieved bandwidth, reported
  against the datasheet peak of the device (by name) and against a large
  device-to-device copy (the practical peak). The same step through the torch
  backend (gather + SDPA) gives the speedup.
* ``engine``: output tokens/s of ``LLM.generate`` on a random-weight Llama of about
  0.35B parameters (hidden 1024, 24 layers, 16 heads over 8 KV heads, intermediate
  2816, vocab 32000) in bf16, on the triton and on the torch backend. The warm-up
  (Triton's first compiles) runs on other prompts, and prefix caching is off, so the
  timed run computes every prompt token.

    python -m bench.gpu [--out gpu-check.json] [--skip-engine]
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

DECODE = dict(batch=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
LLAMA_05B = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=2816,
    vocab_size=32000,
    max_position_embeddings=4096,
)


def table_peak_tbps(name: str) -> float | None:
    return next((tbps for key, tbps in PEAK_TBPS if key in name), None)


def cuda_time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median time of ``fn`` in milliseconds, by CUDA events around each call."""
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


def copy_bandwidth_tbps(nbytes: int = 2 << 30) -> float:
    """A large device-to-device copy: bytes read plus bytes written, per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / (ms * 1e-3) / 1e12


def decode_case(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Caches, layout and this step's q/k/v for the decode shape, on shuffled blocks."""
    from engine.step_layout import StepLayout

    c = DECODE
    per_seq = c["context"] // c["block_size"]
    num_blocks = c["batch"] * per_seq + 1
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(c["batch"])]
    bs, ctx = c["block_size"], c["context"]
    layout = StepLayout(
        slots=[t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for t in tables],
        decode_block_ids=tables,
        decode_context_lens=[ctx] * c["batch"],
        chunks=[],
    )
    torch.manual_seed(seed)
    cache_shape = (num_blocks, bs, c["num_kv_heads"], c["head_dim"])
    caches = [torch.randn(cache_shape, dtype=dtype, device="cuda") for _ in range(2)]
    q = torch.randn(c["batch"], c["num_heads"], c["head_dim"], dtype=dtype, device="cuda")
    kv = [
        torch.randn(c["batch"], c["num_kv_heads"], c["head_dim"], dtype=dtype, device="cuda")
        for _ in range(2)
    ]
    return layout, caches, q, kv


def bench_decode(copy_tbps: float, table_tbps: float | None) -> dict:
    from engine.attention import TorchAttention
    from engine.triton_attention import TritonAttention, decode_attention

    c = DECODE
    layout, (k_cache, v_cache), q, (k, v) = decode_case()
    scale = c["head_dim"] ** -0.5
    triton_backend = TritonAttention(c["block_size"], "cuda", c["head_dim"])
    meta = triton_backend.build_metadata(layout)
    out = torch.empty_like(q)

    def kernels() -> None:
        decode_attention(
            q, k_cache, v_cache, out, meta.decode_block_tables, meta.decode_context_lens,
            meta.max_decode_len, scale, triton_backend.partition_size,
        )  # fmt: skip

    kernel_ms = cuda_time_ms(kernels, iters=50)
    elem = q.element_size()
    kv_bytes = 2 * c["batch"] * c["context"] * c["num_kv_heads"] * c["head_dim"] * elem
    moved = kv_bytes + 2 * q.numel() * elem  # K/V and q read, output written
    achieved = moved / (kernel_ms * 1e-3) / 1e12
    torch_backend = TorchAttention(c["block_size"], torch.device("cuda"))
    torch_meta = torch_backend.build_metadata(layout)
    torch_ms = cuda_time_ms(
        lambda: torch_backend.forward(q, k, v, k_cache, v_cache, torch_meta, scale), iters=10
    )
    triton_ms = cuda_time_ms(
        lambda: triton_backend.forward(q, k, v, k_cache, v_cache, meta, scale), iters=50
    )
    return {
        "shape": {**c, "dtype": "bfloat16", "partition_size": triton_backend.partition_size},
        "bytes_moved": moved,
        "kernel_ms": kernel_ms,
        "achieved_tbps": achieved,
        "fraction_of_table_peak": achieved / table_tbps if table_tbps else None,
        "fraction_of_copy_peak": achieved / copy_tbps,
        "triton_backend_step_ms": triton_ms,
        "torch_backend_step_ms": torch_ms,
        "speedup_vs_torch": torch_ms / triton_ms,
    }


def build_llama_05b(out_dir: Path, dtype: torch.dtype) -> Path:
    """A random-weight Llama checkpoint with the built-in model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.default_model import ensure_default_model

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_05B, bos_token_id=None, eos_token_id=None)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out_dir)
    tokenizer_dir = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def engine_settings(backend: str, num_requests: int) -> dict:
    """The benchmarked engine: prefix caching off, so the warm-up cannot shorten the run."""
    return dict(
        device="cuda", dtype="bfloat16", attention_backend=backend, kv_cache_memory=16 << 30,
        max_num_seqs=num_requests, enable_prefix_caching=False,
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
    model_dir: Path, backend: str, num_requests: int, prompt_len: int, output_len: int
) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), **engine_settings(backend, num_requests))
    warmup, prompts = bench_prompts(num_requests, prompt_len, LLAMA_05B["vocab_size"])
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up: Triton compiles a kernel per specialization (split or not, strides divisible
    # by 16 or not), which a few steps over growing contexts all meet.
    llm.generate(warmup, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}


def run(args: argparse.Namespace) -> dict:
    import triton

    name = torch.cuda.get_device_name()
    table = table_peak_tbps(name)
    copy = copy_bandwidth_tbps()
    result = {
        "device": name,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "table_peak_tbps": table,
        "copy_tbps": copy,
        "decode": bench_decode(copy, table),
    }
    torch.cuda.empty_cache()
    if not args.skip_engine:
        workload = dict(
            num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len
        )
        with tempfile.TemporaryDirectory(prefix="tandem-llama-05b-") as tmp:
            model_dir = build_llama_05b(Path(tmp), torch.bfloat16)
            runs = {b: bench_engine(model_dir, b, **workload) for b in ("triton", "torch")}
        result["engine"] = {
            "model": {**LLAMA_05B, "dtype": "bfloat16"},
            "workload": workload,
            **runs,
            "speedup_vs_torch": runs["triton"]["output_tokens_per_s"]
            / runs["torch"]["output_tokens_per_s"],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="gpu-check.json", help="where to write the JSON results")
    ap.add_argument(
        "--skip-engine", action="store_true", help="only the kernel and copy measurements"
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024, help="> 512: decode splits contexts")
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (torch.cuda.is_available() is False)")
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "versions"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
