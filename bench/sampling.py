"""The sampler's random draw against torch's own, on the same probabilities.

Tandem's draws are reproducible per request: a token depends on the request's seed and
its output index, never on the batch (``engine.model.sampler``: a hashed uniform per row, one
inverse-CDF draw for the batch). ``torch.multinomial`` draws from one global generator,
so a row's token depends on its batch mates; it is the baseline a batch-invariant draw
has to stay near. Greedy (argmax) is the floor.

    python -m bench.sampling [--batches 1,8,32,128] [--vocabs 4096,32000,128256]
                             [--device cpu|cuda] [--repeat 5] [--json FILE]

For each batch size and vocabulary: the best of ``--repeat`` timings of ``sample()``
(temperature 1, nothing else) and of softmax + ``torch.multinomial`` on the same
logits, and their ratio (sampler / multinomial: under 1 is faster).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

from bench.common import write_result
from engine.model.sampler import SampleRow, sample
from engine.wire.sampling_params import SamplingParams


def _best(fn: Callable[[], object], repeat: int, device: str) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in seconds (after one untimed run)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def measure(batch: int, vocab: int, device: str, repeat: int) -> dict:
    logits = torch.randn(batch, vocab, device=device)
    rows = [SampleRow(SamplingParams(temperature=1.0), 1000 + i, (), range(7)) for i in range(batch)]
    ours = _best(lambda: sample(logits, rows), repeat, device)
    torch_draw = _best(lambda: torch.multinomial(logits.softmax(dim=-1), 1), repeat, device)
    greedy = _best(lambda: logits.argmax(dim=-1).tolist(), repeat, device)
    return {"batch": batch, "vocab": vocab, "sample_ms": 1e3 * ours, "multinomial_ms": 1e3 * torch_draw,
            "greedy_ms": 1e3 * greedy, "ratio_vs_multinomial": ours / torch_draw}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--vocabs", default="4096,32000,128256")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            r = measure(batch, vocab, args.device, args.repeat)
            rows.append(r)
            print(f"batch {batch:4d} vocab {vocab:6d}: sample {r['sample_ms']:8.2f} ms, multinomial "
                  f"{r['multinomial_ms']:8.2f} ms ({r['ratio_vs_multinomial']:.2f}x), greedy {r['greedy_ms']:.2f} ms")
    if args.json:
        write_result(args.json, {"device": args.device, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
