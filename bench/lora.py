"""What serving many LoRA adapters at once costs a decode step.

    python -m bench.lora [--model DIR] [--batch 32] [--adapters 8] [--rank 16]
                         [--context 128] [--steps 10] [--rounds 5] [--out FILE]

One engine (``max_loras`` = ``--adapters``) with that many random adapters of ``--rank``
on every projection (PEFT's files, written to a temporary folder) decodes ``--batch``
requests of ``--context`` tokens three ways, in interleaved rounds: all on the base
model; the requests spread evenly over the adapters, the grouped path (two dense products
a projection for the whole step, ``engine.model.lora``); and the same requests with the
adapters applied one at a time over their own rows (the per-adapter loop, the baseline).
Reports each one's median step time and the ratios: grouped / base (the target: at most
1.3x at batch 32 with 8 adapters of rank 16) and loop / grouped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_engine_arguments, engine_overrides, write_result
from engine import LLMEngine, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, engine: LLMEngine, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of ``rank`` on every projection of ``engine``'s model."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shapes = engine.lora.target_shapes()
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(len(engine.model.layers)):
        for target in TARGETS:
            n_in, n_out = shapes[target]
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if target[0] in 'qkvo' else 'mlp'}.{target}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.01
            weights[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    save_file(weights, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def decode_ms(engine: LLMEngine, adapters: list[str | None], context: int, steps: int) -> float:
    """Mean ms of ``steps`` decode steps of one request per entry of ``adapters``."""
    ids = [engine.add_request([5 + i % 50] * context, SamplingParams(max_tokens=10**6, ignore_eos=True,
                                                                   temperature=0.0, adapter=a))
           for i, a in enumerate(adapters)]
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < 3:  # the prefill and a few decode steps first
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    engine.abort(ids)
    return dt * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    add_engine_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    engine = LLMEngine(model=args.model, max_loras=args.adapters, max_lora_rank=args.rank,
                       max_num_seqs=max(256, args.batch), enable_prefix_caching=False, **engine_overrides(args))
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            engine.load_adapter(name, str(write_adapter(Path(tmp) / name, engine, args.rank, seed=i)))
    spread = [names[i % len(names)] for i in range(args.batch)]
    step = engine.lora.step
    times: dict[str, list[float]] = {"base": [], "grouped": [], "loop": []}
    for _ in range(args.rounds):
        times["base"].append(decode_ms(engine, [None] * args.batch, args.context, args.steps))
        times["grouped"].append(decode_ms(engine, spread, args.context, args.steps))
        step.grouped = False
        times["loop"].append(decode_ms(engine, spread, args.context, args.steps))
        step.grouped = True
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "batch": args.batch, "adapters": args.adapters, "rank": args.rank, "context": args.context,
        "step_ms": {k: round(v, 2) for k, v in med.items()},
        "grouped_over_base": round(med["grouped"] / med["base"], 3),
        "loop_over_grouped": round(med["loop"] / med["grouped"], 3),
    }
    print(f"decode step at batch {args.batch}, {args.adapters} adapters of rank {args.rank}: "
          f"base {med['base']:.2f} ms, grouped {med['grouped']:.2f} ms "
          f"({result['grouped_over_base']:.2f}x base), per-adapter loop {med['loop']:.2f} ms "
          f"({result['loop_over_grouped']:.2f}x grouped)")
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
