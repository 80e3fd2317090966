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
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

# The measurements live beside this program: on random tensors in bench/gpu_kernels.py, on
# the random-weight model in bench/gpu_engine.py. ``run`` calls them through this module's
# names (which tests replace); the ones tests and other programs use are imported from here.
from bench.gpu_engine import (
    BATCHING,
    TRANSFER,
    bench_batching,
    bench_prompts,
    bench_steps,
    bench_transfer,
    build_llama_05b,
    engine_section,
    engine_settings,
    handoff,
)
from bench.gpu_kernels import (
    bench_checksums,
    bench_decode,
    bench_prefill,
    bench_sampling,
    causal_flops,
    copy_bandwidth,
    paged_layout,
    paged_tensors,
    profile_row,
    table_peak_tbps,
)

__all__ = [
    "PROFILE_FORMAT", "bench_batching", "bench_checksums", "bench_decode", "bench_prefill", "bench_prompts",
    "bench_sampling", "bench_steps", "bench_transfer", "build_llama_05b", "causal_flops", "copy_bandwidth",
    "engine_section", "engine_settings", "handoff", "main", "paged_layout", "paged_tensors", "profile_row",
    "profile_table", "run", "saver", "summary", "table_peak_tbps",
]

PROFILE_FORMAT = "tandem-gpu-profile/1"


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
