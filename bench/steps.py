"""Decode step time against batch size, on the engine alone.

What an empty seat in a batch costs decides how much continuous batching gains over
static batching: if a step's time grew in proportion to its batch, an empty seat
would cost nothing. This measures it:

    python -m bench.steps [--model DIR] [--context 128] [--batches 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch

from engine import LLMEngine, SamplingParams


def step_times(engine: LLMEngine, batches: Sequence[int], context: int, steps: int) -> list[dict]:
    rows = []
    for b in batches:
        ids = [f"b{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            params = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0)
            engine.add_request([5 + i] * context, params, request_id=rid)
        for _ in range(5):  # the prefill, then a few warm-up decode steps
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        dt = (time.perf_counter() - t0) / steps
        engine.abort(ids)
        rows.append({"batch": b, "step_ms": round(dt * 1000, 2), "tokens_per_s": round(b / dt, 1)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (workers use 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(model=args.model, num_kv_blocks=max(batches) * (args.context // 16 + 8) + 64)
    rows = step_times(engine, batches, args.context, args.steps)
    for r in rows:
        print(f"batch {r['batch']:4d}: decode step {r['step_ms']:7.2f} ms, {r['tokens_per_s']:8.1f} tokens/s")
    print(json.dumps(rows))
    assert engine.stats().num_blocks_in_use == 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
