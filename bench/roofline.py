"""Decode step time against this machine's roofline, and against transformers.

A decode step at batch B reads every weight once and the KV of the B requests, and
does about 2 FLOPs per weight per request plus attention. Its floor on this machine is
the larger of bytes / memory bandwidth and FLOPs / GEMM rate, both measured here in the
same run (a large tensor copy; a square fp32 matmul), so the ratio of the measured step
to that floor says how far the engine is from what the hardware allows. transformers'
static ``generate`` at the same batch and context is the reference implementation; its
step is timed between two calls of its logits processors.
Used by ``tandem bench offline --decode-batches``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.model.model_config import ModelConfig


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of a large copy (each byte read once and written once)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_of(lambda: dst.copy_(src), repeats)


def gemm_flops(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOPs per second of an n x n x n matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best_of(lambda: torch.mm(a, b), repeats)


def _matmul_weights(cfg: ModelConfig) -> tuple[int, int]:
    """Weights multiplied per token: (all layers', the head's)."""
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    q_dim = cfg.num_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q_dim + 2 * kv_dim) + q_dim * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer, cfg.vocab_size * cfg.hidden_size


def workload_flops(cfg: ModelConfig, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """FLOPs a workload needs at least: every prompt and output token through the layers
    (2 per weight), the head once per output token, and causal attention (QK^T and PV
    over the tokens before each one)."""
    layers, head = _matmul_weights(cfg)
    attention_per_pair = 2 * 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    total = 0
    for p, o in zip(prompt_lens, output_lens):
        n = p + o
        total += 2 * layers * n + 2 * head * o + attention_per_pair * n * (n + 1) // 2
    return total


def step_cost(cfg: ModelConfig, batch: int, context: int, elem: int = 4) -> dict:
    """Bytes read and FLOPs of one decode step of ``batch`` requests at ``context`` tokens:
    every matmul weight once (the layers' and the head's, however they are stored or
    copied; the embedding lookup reads only its rows) and each request's KV."""
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    matmul_weights = sum(_matmul_weights(cfg))
    attention = 2 * 2 * context * cfg.num_heads * cfg.head_dim * cfg.num_layers  # QK^T and PV, per request
    kv_bytes = batch * context * 2 * kv_dim * cfg.num_layers * elem
    return {"bytes": matmul_weights * elem + kv_bytes, "flops": batch * (2 * matmul_weights + attention)}


def roofline_s(cost: dict, bandwidth: float, flops: float) -> tuple[float, str]:
    memory, compute = cost["bytes"] / bandwidth, cost["flops"] / flops
    return (memory, "memory") if memory >= compute else (compute, "compute")


def hf_step_times(model, batches: Sequence[int], context: int, steps: int) -> dict[int, float]:
    """Seconds per decode step of transformers' ``generate`` (no padding, no EOS): the
    mean time between its calls to the logits processors after the first (the prefill)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    out = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.tensor([[5 + i] * context for i in range(b)])
            clock = Clock()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 2, do_sample=False,
                           eos_token_id=None, pad_token_id=0,
                           logits_processor=LogitsProcessorList([clock]))  # fmt: skip
            # times[0] ends the prefill, times[1] the first decode step (a warm-up).
            out[b] = (clock.times[-1] - clock.times[1]) / (len(clock.times) - 2)
    return out


def decode_table(model_dir: str, batches: Sequence[int], context: int, steps: int, hf_model=None) -> dict:
    """The engine's decode step per batch size, its roofline and the ratio to transformers."""
    from bench.steps import step_times
    from engine import LLMEngine

    engine = LLMEngine(model=model_dir, num_kv_blocks=max(batches) * (context // 16 + 8) + 64)
    cfg = engine.model_config
    weight_bytes = engine.model.weight_bytes()
    bandwidth, flops = memory_bandwidth(), gemm_flops()
    rows = step_times(engine, batches, context, steps)
    del engine
    hf = hf_step_times(hf_model, batches, context, steps) if hf_model is not None else {}
    for row in rows:
        b = row["batch"]
        floor, bound = roofline_s(step_cost(cfg, b, context), bandwidth, flops)
        row.update(roofline_ms=round(floor * 1000, 2), bound=bound,
                   step_over_roofline=round(row["step_ms"] / 1000 / floor, 2))  # fmt: skip
        if b in hf:
            row.update(hf_step_ms=round(hf[b] * 1000, 2), speedup_vs_hf=round(hf[b] * 1000 / row["step_ms"], 2))
    return {
        "context": context, "steps": steps, "weight_bytes": weight_bytes,
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2), "gemm_gflop_s": round(flops / 1e9, 2),
        "rows": rows,
    }  # fmt: skip
