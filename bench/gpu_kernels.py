"""The GPU benchmark's measurements on random tensors: a device-to-device copy, the Triton
attention kernels (paged decode, prefill), the sampler's draw and the per-block KV checksums,
each with its profile-table row, and the timing helpers they and ``bench/gpu_engine.py`` share.

``bench/gpu.py`` is the program: it runs these and ``bench/gpu_engine.py``'s measurements
(on a random-weight model) in order and writes the JSON and the profile table; its
docstring says what each measures.
"""

from __future__ import annotations

import random
import statistics
import time

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
    empty_device_cache(device)
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
    empty_device_cache(device)
    result["sweep"] = [one(n, length)["row"] for n, length in sweep]
    return result


def sync_device(device: str) -> None:
    """Wait for ``device``'s queued work (a CUDA device; nothing elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def empty_device_cache(device: str) -> None:
    """Hand ``device``'s cached free memory back (a CUDA device; nothing elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


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


def bench_sampling(batches=(8, 32, 128), vocabs=(32000, 128256), device: str = "cuda") -> dict:
    """The sampler's random draw (one batched inverse-CDF draw, seeded per request) against
    softmax + ``torch.multinomial`` on the same logits (``bench.sampling``)."""
    from bench.sampling import measure as measure_draw

    return {"rows": [measure_draw(b, v, device, repeat=10) for v in vocabs for b in batches]}
