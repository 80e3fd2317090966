"""Per-request disaggregation: short prompts computed on their decode worker, long ones
through the prefill pool, against always disaggregating and against colocated serving.

    python -m bench.local_prefill [--num-requests 60] [--request-rate 4] [--short-len 24]
                                  [--long-len 1024] [--long-fraction 0.25] [--output-len 32]
                                  [--local-prefill-tokens 64] [--out FILE]

Runs ``bench.serve`` (``--launch``, the ``long-mix`` workload: short prompts with a share
of long ones) three times on the same requests: 1 prefill + 1 decode worker always
disaggregated; the same with ``--local-prefill-tokens`` (prompts with at most that many
tokens uncached on their decode worker are computed there); and 2 colocated workers.
Reported per configuration: TTFT p50 of the short prompts, ITL p50 of the long ones,
and how many requests were computed locally. The issue's aim: short prompts' TTFT with
the local rule at most the colocated one, long prompts' ITL unchanged from always
disaggregating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import serve

CONFIGS = {
    "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1"],
    "local": ["--prefill-workers", "1", "--decode-workers", "1"],  # + --local-prefill-tokens
    "colocated": ["--prefill-workers", "0", "--decode-workers", "2"],
}


def by_group(requests: Sequence[dict]) -> dict:
    """TTFT p50 of the short prompts and ITL p50 of the long ones, in ms."""
    done = [r for r in requests if r["ok"]]
    short = [r["ttft_s"] for r in done if r["group"] == "short"]
    long_gaps = [g for r in done if r["group"] == "long" for g in r["itl_s"]]
    return {
        "completed": len(done), "failed": len(requests) - len(done),
        "short_ttft_p50_ms": round(1000 * statistics.median(short), 1) if short else None,
        "long_itl_p50_ms": round(1000 * statistics.median(long_gaps), 1) if long_gaps else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--request-rate", default="4")
    ap.add_argument("--short-len", type=int, default=24)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--local-prefill-tokens", type=int, default=64)
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray")
    ap.add_argument("--model", default=None, help="default: the built-in test model")
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)
    common = [
        "--launch", "--workload", "long-mix", "--input-len", str(args.short_len), "--long-len", str(args.long_len),
        "--long-fraction", str(args.long_fraction), "--output-len", str(args.output_len),
        "--num-requests", str(args.num_requests), "--request-rate", args.request_rate, "--no-progress",
        "--engine", "enable_prefix_caching=false",  # every run computes every prompt
    ]
    if args.model:
        common += ["--model", args.model]
    if args.num_cpus:
        common += ["--num-cpus", str(args.num_cpus)]
    figures = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-local-") as tmp:
        for name, flags in CONFIGS.items():
            extra = ["--local-prefill-tokens", str(args.local_prefill_tokens)] if name == "local" else []
            out = Path(tmp) / f"{name}.json"
            if serve.main([*common, *flags, *extra, "--result-json", str(out), "--label", name]) != 0:
                raise SystemExit(f"bench.serve failed for {name}")
            (run,) = json.loads(out.read_text())["runs"]
            figures[name] = by_group(run["requests"])
            print(f"{name:14} {figures[name]}", flush=True)
    local, colocated, disagg = figures["local"], figures["colocated"], figures["disaggregated"]
    figures["local_short_ttft_over_colocated"] = round(local["short_ttft_p50_ms"] / colocated["short_ttft_p50_ms"], 2)
    figures["local_long_itl_over_disaggregated"] = round(local["long_itl_p50_ms"] / disagg["long_itl_p50_ms"], 2)
    print(json.dumps(figures))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
