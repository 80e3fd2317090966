"""Offline throughput: this engine against Hugging Face transformers on the same model.

Workload (fixed by seed): N requests, random-token prompts of uniform length and
uniform output lengths, greedy with ignore_eos, so every system produces exactly the
same number of useful tokens. Measured in one run:

* ``tandem``: ``LLM.generate`` over all requests (continuous batching), and the share
  of the compute roofline it reached: the workload's FLOPs (``bench.roofline.
  workload_flops``) over the fp32 GEMM rate measured in the same run;
* ``hf_static``: transformers ``generate`` in static batches (left padding); a batch
  runs until its longest request is done, and only requested tokens count;
* ``hf_continuous``: transformers' own continuous batching (``init_continuous_batching``), when installed and asked for;
* ``schedule``: the cost of one ``Scheduler.schedule()`` with 256 requests decoding
  (median and mean of many calls; ``time_schedule`` alone needs no model);
* ``decode`` (``--decode-batches 1,8,32,64``): the engine's decode step time at each batch
  size against this machine's roofline for that step -- the larger of the bytes it must
  read (weights, plus the KV of the batch) over the memory bandwidth and its FLOPs over
  the fp32 GEMM rate, both measured in the same run -- and against transformers' static
  ``generate`` step at the same batch.

Writes JSON with the throughputs and their ratios. ``--model`` takes a named model
(``smollm2-135m-instruct``), a checkpoint directory or a ``.gguf`` file.

    tandem bench offline [--num-requests 256] [--out bench-results/offline.json]
    tandem bench offline --model smollm2-135m-instruct --decode-batches 1,8,32,64 --skip-throughput
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from bench.common import write_result


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    outputs = [rng.randint(*output_len) for _ in range(n)]
    return prompts, outputs


def run_tandem(model_dir: str, prompts, outputs, **engine_kwargs) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, **engine_kwargs)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    stats = llm.stats()
    assert stats.num_blocks_in_use == 0, "KV blocks leaked"
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "token_ids": [o.token_ids for o in outs],
    }


def hf_model(model_dir: str):
    """transformers' model for a checkpoint directory or a .gguf file, in float32."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if path.suffix.lower() == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_hf_static(model_dir: str, prompts, outputs, batch_size: int) -> dict:
    model = hf_model(model_dir)
    useful = 0
    token_ids = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch, lens = prompts[b : b + batch_size], outputs[b : b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            new = max(lens)
            gen = model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0,
                # min_new_tokens only masks EOS; with no EOS at all every row runs to
                # ``new`` tokens the way the engine's ignore_eos does.
                eos_token_id=None,
            )
            for row, n in zip(gen[:, width:].tolist(), lens):
                token_ids.append(row[:n])
                useful += n
    elapsed = time.perf_counter() - t0
    return {
        "seconds": elapsed,
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed,
        "batch_size": batch_size,
        "token_ids": token_ids,
    }


def explain_differences(model, prompts, ours, reference) -> list[dict]:
    """For each output that differs from the reference: where it first differs, and by
    how much the reference model's own logits there prefer its token over ours (one
    unpadded forward pass). A gap of a few 1e-6 is a tie in float32, which any other
    summation order may break the other way; a large one is a real difference."""
    found = []
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a == b:
            continue
        p = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        row = {"request": i, "position": p}
        if p < min(len(a), len(b)):
            with torch.inference_mode():
                ids = torch.tensor([prompts[i] + a[:p]], device=model.device)
                logits = model(ids).logits[0, -1].float()
            row.update(ours=a[p], reference=b[p], logit_gap=float(logits[b[p]] - logits[a[p]]))
        found.append(row)
    return found


def run_hf_continuous(model_dir: str, prompts, outputs) -> dict:
    """transformers' own continuous batching: one manager, per-request output lengths."""
    from transformers import GenerationConfig

    model = hf_model(model_dir)
    cfg = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=cfg)
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = [
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, outputs))
        ]
        useful, pending = 0, set(ids)
        while pending:
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped before finishing")
            if result.request_id in pending and result.is_finished():
                pending.discard(result.request_id)
                useful += len(result.generated_tokens)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return {"seconds": elapsed, "output_tokens": useful, "output_tokens_per_s": useful / elapsed}


def compute_roofline(model_dir: str, prompts, outputs, seconds: float) -> dict:
    """The workload's FLOPs over this machine's fp32 GEMM rate (measured now, on the
    same threads): the least time it could take, and the share of it a run reached."""
    from bench.roofline import gemm_flops, workload_flops
    from engine.model.model_config import ModelConfig

    flops = workload_flops(ModelConfig.from_pretrained(model_dir), [len(p) for p in prompts], outputs)
    rate = gemm_flops()
    return {"workload_flops": flops, "gemm_gflop_s": round(rate / 1e9, 1),
            "roofline_s": flops / rate, "fraction_of_roofline": flops / rate / seconds}


def time_schedule(num_running: int, iters: int = 200) -> dict:
    """Median and mean cost of schedule() with ``num_running`` requests decoding (no model)."""
    from engine.core.block_pool import KVCacheManager
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler, SchedulerConfig
    from engine.wire.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=num_running * 64, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_running), kv)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    rng = random.Random(0)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", [rng.randrange(1000) for _ in range(200)], params))
    # Drive everyone through prefill into decode.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        out = sched.schedule()
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.sample})
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = sched.schedule()
        times.append(time.perf_counter() - t0)
        assert len(out.scheduled) == num_running
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled})
    return {"num_running": num_running, "iters": iters,
            "median_us": statistics.median(times) * 1e6, "mean_us": statistics.fmean(times) * 1e6}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem bench offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a named model, checkpoint directory or .gguf file (default: tandem-tiny-llama)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-continuous", action="store_true", help="also time transformers' continuous batching")
    ap.add_argument("--skip-throughput", action="store_true", help="only the decode step table")
    ap.add_argument("--decode-batches", default="", help="e.g. 1,8,32,64: decode step time vs roofline and HF")
    ap.add_argument("--decode-context", type=int, default=128, help="prompt tokens per request in the table")
    ap.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="bench-results/offline.json")
    return ap


def _throughput(args: argparse.Namespace, model_dir: str, vocab: int, result: dict) -> None:
    prompts, outputs = make_workload(args.num_requests, args.prompt_len, args.output_len, vocab, args.seed)
    print(f"tandem: {args.num_requests} requests ...", flush=True)
    tandem = run_tandem(model_dir, prompts, outputs)
    print(f"  {tandem['output_tokens_per_s']:.0f} output tok/s in {tandem['seconds']:.1f} s", flush=True)
    tandem.update(compute_roofline(model_dir, prompts, outputs, tandem["seconds"]))
    print(f"  compute roofline {tandem['roofline_s']:.1f} s ({tandem['gemm_gflop_s']} GFLOP/s): "
          f"{tandem['fraction_of_roofline']:.0%} of it", flush=True)
    if not args.skip_hf:
        print(f"hf static batches of {args.hf_batch_size} ...", flush=True)
        hf = run_hf_static(model_dir, prompts, outputs, args.hf_batch_size)
        print(f"  {hf['output_tokens_per_s']:.0f} output tok/s in {hf['seconds']:.1f} s", flush=True)
        reference = hf.pop("token_ids")
        same = sum(a == b for a, b in zip(tandem["token_ids"], reference))
        result["hf_static"] = hf
        result["ratio_vs_hf_static"] = tandem["output_tokens_per_s"] / hf["output_tokens_per_s"]
        result["greedy_outputs_identical_to_hf"] = f"{same}/{args.num_requests}"
        print(f"  ratio {result['ratio_vs_hf_static']:.2f}x; identical outputs {same}/{args.num_requests}")
        if same < args.num_requests:
            diffs = result["greedy_output_differences"] = explain_differences(
                hf_model(model_dir), prompts, tandem["token_ids"], reference)
            for d in diffs:
                print(f"  request {d['request']} differs from token {d['position']}: transformers' logits prefer "
                      f"its token by {d.get('logit_gap', float('nan')):.2g}")
    if args.hf_continuous:
        print("hf continuous batching ...", flush=True)
        hfc = run_hf_continuous(model_dir, prompts, outputs)
        result["hf_continuous"] = hfc
        result["ratio_vs_hf_continuous"] = tandem["output_tokens_per_s"] / hfc["output_tokens_per_s"]
        print(f"  {hfc['output_tokens_per_s']:.0f} output tok/s; ratio {result['ratio_vs_hf_continuous']:.2f}x")
    tandem.pop("token_ids")
    result["tandem"] = tandem


def _decode(args: argparse.Namespace, model_dir: str, result: dict) -> None:
    from bench.roofline import decode_table

    batches = [int(b) for b in args.decode_batches.split(",")]
    print(f"decode steps at batch {batches}, context {args.decode_context} ...", flush=True)
    table = decode_table(model_dir, batches, args.decode_context, args.decode_steps,
                         None if args.skip_hf else hf_model(model_dir))  # fmt: skip
    print(f"  memory bandwidth {table['memory_bandwidth_gb_s']} GB/s, fp32 GEMM {table['gemm_gflop_s']} GFLOP/s, "
          f"weights {table['weight_bytes'] / 1e6:.0f} MB")
    for r in table["rows"]:
        hf = f", HF {r['hf_step_ms']} ms ({r['speedup_vs_hf']}x)" if "hf_step_ms" in r else ""
        print(f"  batch {r['batch']:3d}: {r['step_ms']} ms, roofline {r['roofline_ms']} ms ({r['bound']}), "
              f"{r['step_over_roofline']}x the roofline{hf}")
    result["decode"] = table


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from engine.model.model_config import ModelConfig
    from engine.model.model_registry import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model).path
    result: dict = {
        "workload": {
            "num_requests": args.num_requests, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "seed": args.seed, "model": model_dir,
        },
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
    }
    if not args.skip_throughput:
        _throughput(args, model_dir, ModelConfig.from_pretrained(model_dir).vocab_size, result)
        result["schedule"] = time_schedule(256)
        print(f"schedule() with 256 running: {result['schedule']['median_us']:.0f} us (median)")
    if args.decode_batches:
        _decode(args, model_dir, result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
