"""Decode step time against batch size, on the engine alone.

What an empty seat in a batch costs decides how much continuous batching gains over
static batching: if a step's time grew in proportion to its batch, an empty seat
would cost nothing. This measures it:

    python -m bench.steps [--model DIR] [--context 128] [--batches 1,2,4,8,16,32]
                          [--baseline unpacked|torch-attention]

``--baseline`` also times each batch size on a second engine, alternating with the
default one, and reports the ratio (baseline step time / default): ``unpacked`` (also
``--unpacked``) has plain ``nn.Linear`` projections (``pack_weights=False``),
``torch-attention`` gathers K/V and calls SDPA (``attention_backend="torch"``) where the
default reads the paged cache in place (``cpu``).

``--device cuda --dtype bfloat16 --attention-backend triton`` measure a GPU engine the
same way (``scripts/gpu-check`` writes such a table for a ~0.35B model).

``--profile FILE`` also times whole-prompt prefill steps (``--prefill-lengths``, one
prompt and four at once) and steps that prefill one prompt beside a decoding batch, and
writes every measured step as a profile table for the simulator's cost model
(``sim.cost``: the format is in its docstring), from which ``tandem sim --device-kind
cpu --profile FILE`` fits this machine's corrections.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Sequence

import torch

from bench.common import add_engine_arguments, device_kind, engine_overrides, write_result
from engine import LLMEngine, SamplingParams

# The second engine's settings for each --baseline.
BASELINES = {"unpacked": {"pack_weights": False}, "torch-attention": {"attention_backend": "torch"}}


def decode_kv_blocks(seats: int, context: int) -> int:
    """KV blocks (of 16 tokens) for ``seats`` requests of ``context`` prompt tokens, the
    tokens they decode while timed, and a margin: what a step-timing engine is given."""
    return seats * (context // 16 + 8) + 64


def step_times(engine: LLMEngine, batches: Sequence[int], context: int, steps: int) -> list[dict]:
    rows = []
    for b in batches:
        ids = [f"b{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            params = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0)
            engine.add_request([5 + i] * context, params, request_id=rid)
        # The prefill (over several steps when the batch's prompts exceed one step's token
        # budget), then a few warm-up decode steps: 5 tokens each, so no timed step prefills.
        produced = dict.fromkeys(ids, 0)
        while min(produced.values()) < 5:
            for out in engine.step():
                produced[out.request_id] += len(out.new_token_ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        dt = (time.perf_counter() - t0) / steps
        engine.abort(ids)
        rows.append({"batch": b, "step_ms": round(dt * 1000, 2), "tokens_per_s": round(b / dt, 1)})
    return rows


def prefill_times(engine: LLMEngine, lengths: Sequence[int], repeats: int = 3) -> list[tuple[list[int], float]]:
    """(prompt lengths, median ms) of steps that each compute whole fresh prompts: one of each
    length alone, then four of it at once while that fits the step's budget."""
    budget = engine.scheduler.config.max_num_batched_tokens
    batches = [[n] for n in lengths] + [[n] * 4 for n in lengths if 4 * n <= budget]
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    rows, fresh = [], itertools.count(1)
    for batch in batches:
        times = []
        for _ in range(repeats):
            for n in batch:  # a first token no earlier prompt had: no prefix-cache hit
                k = next(fresh)
                engine.add_request([5 + k % 97, 5 + k // 97 % 97] + [7] * (n - 2), params)
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1000)
        rows.append((batch, sorted(times)[len(times) // 2]))
    return rows


def mixed_times(engine: LLMEngine, batches: Sequence[int] = (4, 16), lengths: Sequence[int] = (64, 256),
                context: int = 128, repeats: int = 3) -> list[tuple[int, int, int, float]]:
    """(batch, decode context, prompt length, median ms) of steps that decode ``batch``
    requests and compute one fresh prompt whole beside them (what chunked prefill mixes)."""
    decoding = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0)
    once = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    rows, fresh = [], itertools.count(10_000)
    for b in batches:
        ids = [f"m{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            engine.add_request([5 + i] * context, decoding, request_id=rid)
        done = 0
        for _ in range(3):  # the prefill, then two decode steps
            engine.step()
            done += 1
        for n in lengths:
            times = []
            for _ in range(repeats):
                k = next(fresh)  # a first token no earlier prompt had: no prefix-cache hit
                engine.add_request([5 + k % 97, 5 + k // 97 % 97] + [7] * (n - 2), once)
                t0 = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - t0) * 1000)
                done += 1
            rows.append((b, context + done - 1 - repeats // 2, n, sorted(times)[len(times) // 2]))
        engine.abort(ids)
    return rows


def profile_rows(decodes: dict[int, list[dict]], steps: int, prefills: list[tuple[list[int], float]],
                 mixed: Sequence[tuple[int, int, int, float]] = ()) -> list[dict]:
    """The measured steps as a ``sim.cost`` profile table's rows: ``decodes`` maps a prompt
    length to its decode rows (``step_times``), each taken at its mean context (the prompt,
    the warm-up steps, half the timed ones); ``prefills`` are ``prefill_times``' rows and
    ``mixed`` ``mixed_times``'."""
    from sim.cost import decode_shape, merge, prefill_shape
    from sim.fitting import profile_row

    rows = [profile_row(decode_shape(r["batch"], context + 5 + steps // 2), r["step_ms"])
            for context, decode_rows in decodes.items() for r in decode_rows]
    rows += [profile_row(prefill_shape(batch), ms) for batch, ms in prefills]
    rows += [profile_row(merge(decode_shape(b, ctx), prefill_shape([n])), ms) for b, ctx, n, ms in mixed]
    return rows


def measure_profile(engine: LLMEngine, batches: Sequence[int], contexts: Sequence[int], steps: int,
                    prefill_lengths: Sequence[int], done: dict[int, list[dict]] | None = None,
                    mixed_batches: Sequence[int] = (4, 16), mixed_lengths: Sequence[int] = (64, 256)) -> list[dict]:
    """Time decode steps at each of ``contexts``, whole-prompt prefill steps and mixed ones
    (``mixed_times``) on ``engine``, printing each, and return them as profile rows; ``done``
    holds decode rows already measured, by context."""
    decodes = dict(done or {})
    for context in contexts:
        if context not in decodes:
            decodes[context] = step_times(engine, batches, context, steps)
            print(f"decode at {context}: " + ", ".join(f"{r['batch']}: {r['step_ms']} ms" for r in decodes[context]))
    prefills = prefill_times(engine, prefill_lengths)
    for batch, ms in prefills:
        print(f"prefill {len(batch)} x {batch[0]:5d} tokens: {ms:7.2f} ms")
    mixed = mixed_times(engine, mixed_batches, mixed_lengths)
    for b, ctx, n, ms in mixed:
        print(f"decode {b:3d} at {ctx} + prefill {n:4d} tokens: {ms:7.2f} ms")
    return profile_rows(decodes, steps, prefills, mixed)


def profile_table(engine: LLMEngine, device: str, name: str, rows: list[dict]) -> dict:
    """A ``sim.cost`` profile table (``tandem-step-profile/1``) of ``engine``'s measured steps."""
    from sim.cost import ModelSpec
    from sim.fitting import step_profile

    model = ModelSpec.from_model_config(name, engine.model_config)
    return step_profile(device, model, engine.kv_cache.k.element_size(), rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (workers use 1)")
    ap.add_argument("--baseline", choices=sorted(BASELINES), help="compare with a second engine")
    ap.add_argument("--unpacked", dest="baseline", action="store_const", const="unpacked", help="--baseline unpacked")
    ap.add_argument("--profile", default=None, help="also time prefill steps and write a profile table here")
    ap.add_argument("--prefill-lengths", default="16,64,128,256,512,1024")
    ap.add_argument("--profile-contexts", default="512", help="more prompt lengths to time decode steps at")
    ap.add_argument("--model-name", default=None, help="the model's name in the profile (default: --model)")
    add_engine_arguments(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    longest = max([args.context] + ([int(c) for c in args.profile_contexts.split(",")] if args.profile else []))
    num_kv_blocks = decode_kv_blocks(max(batches), longest)
    settings = {"model": args.model, "num_kv_blocks": num_kv_blocks, **engine_overrides(args)}
    engines = [LLMEngine(**settings)]
    if args.baseline:
        engines.append(LLMEngine(**{**settings, **BASELINES[args.baseline]}))
    name = args.baseline
    rows = []
    for b in batches:  # the engines alternate, so a slow spell of the machine hits both
        row, *base = (step_times(e, [b], args.context, args.steps)[0] for e in engines)
        if base:
            row[f"{name}_step_ms"] = base[0]["step_ms"]
            row[f"{name}_over_default"] = round(base[0]["step_ms"] / row["step_ms"], 2)
        rows.append(row)
        extra = f", {name} {row[f'{name}_step_ms']:7.2f} ms ({row[f'{name}_over_default']:.2f}x)" if base else ""
        print(f"batch {b:4d}: decode step {row['step_ms']:7.2f} ms, {row['tokens_per_s']:8.1f} tokens/s{extra}")
    print(json.dumps(rows))
    if args.profile:
        contexts = [int(c) for c in args.profile_contexts.split(",")]
        rows = measure_profile(engines[0], batches, contexts, args.steps,
                               [int(n) for n in args.prefill_lengths.split(",")], done={args.context: rows})
        model_name = args.model_name or args.model or "tandem-tiny-llama"
        write_result(args.profile, profile_table(engines[0], device_kind(args.device), model_name, rows))
    assert all(e.stats().num_blocks_in_use == 0 for e in engines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
