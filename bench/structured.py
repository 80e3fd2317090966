"""Structured output: what a grammar costs the offline engine.

Measured in one run, on one engine:

* ``compile``: building xgrammar's compiler from the tokenizer (once per engine), then
  compiling a JSON schema of ``--properties`` properties the first time (cold) and
  again (cached: the engine's cache by kind and spec);
* ``decode``: a batch of ``--batch`` greedy requests constrained by that schema, against
  the same prompts unconstrained (``ignore_eos``, each request's ``max_tokens`` set to
  the length its constrained twin produced, so both runs make the same tokens). The
  two runs alternate ``--repeats`` times and each keeps its fastest, so load from
  elsewhere on the machine weighs on both alike. The ratio is constrained over
  unconstrained output tokens/s. It is not the mask's cost alone: the free run's
  random tokens (bytes that are not UTF-8 yet, special tokens) cost the detokenizer
  more than JSON text does, so it can exceed 1. The mask's own cost is
  ``mask_ms_per_step``, the time spent filling the batch's bitmask from the matchers
  per step, and ``mask_share``, that time's share of the constrained runs.

    python -m bench.structured [--model DIR] [--batch 32] [--properties 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import time

from bench.common import write_result


def schema_of(n: int) -> dict:
    """``n`` required properties, cycling through bounded kinds (so a random model ends)."""
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "string", "maxLength": 6},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def measure_compile(llm, so) -> dict:
    structured = llm.engine.structured
    t0 = time.perf_counter()
    structured.warm_up()  # the compiler, from the tokenizer's vocabulary
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    structured.compiled(so).result()
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    structured.compiled(so).result()
    cached_s = time.perf_counter() - t0
    return {"compiler_init_s": init_s, "cold_s": cold_s, "cached_s": cached_s}


class _Timed:
    """Wraps ``StructuredOutputs.bitmask`` to add up the time it takes and its calls."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        t0 = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def _timed_generate(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t0


def measure_decode(llm, so, batch: int, max_tokens: int, repeats: int) -> dict:
    from engine import SamplingParams

    prompts = [f"Record {i} of the inventory, as JSON:" for i in range(batch)]
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=so)
    outs, _ = _timed_generate(llm, prompts, constrained)  # warm-up; fixes the lengths
    lengths = [len(o.token_ids) for o in outs]
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    structured = llm.engine.structured
    timer = structured.bitmask = _Timed(structured.bitmask)
    constrained_s = free_s = float("inf")
    constrained_total = 0.0
    for _ in range(repeats):
        outs, seconds = _timed_generate(llm, prompts, constrained)
        constrained_s = min(constrained_s, seconds)
        constrained_total += seconds
        free_outs, seconds = _timed_generate(llm, prompts, free)
        free_s = min(free_s, seconds)
    del structured.bitmask
    tokens = sum(lengths)
    assert [len(o.token_ids) for o in outs] == lengths, "greedy constrained runs must repeat themselves"
    assert tokens == sum(len(o.token_ids) for o in free_outs), "both runs must make the same tokens"
    assert llm.stats().num_blocks_in_use == 0, "KV blocks leaked"
    finished = sum(o.finish_reason == "stop" for o in outs)
    return {
        "batch": batch,
        "output_tokens": tokens,
        "constrained_completed": finished,
        "constrained_tokens_per_s": tokens / constrained_s,
        "unconstrained_tokens_per_s": tokens / free_s,
        "ratio": (tokens / constrained_s) / (tokens / free_s),
        "mask_ms_per_step": 1e3 * timer.seconds / max(timer.calls, 1),
        "mask_share": timer.seconds / constrained_total,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory, .gguf file or named model (default: built-in)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--properties", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--out", default="bench-results/structured.json")
    args = p.parse_args(argv)

    from engine import LLM
    from engine.wire.sampling_params import StructuredOutput

    llm = LLM(model=args.model, num_kv_blocks=args.num_kv_blocks)
    so = StructuredOutput.json_schema(schema_of(args.properties))
    compile_times = measure_compile(llm, so)
    decode = measure_decode(llm, so, args.batch, args.max_tokens, args.repeats)
    result = {
        "model": llm.engine.model_name,
        "machine": platform.machine(),
        "properties": args.properties,
        "compile": compile_times,
        "decode": decode,
    }
    print(
        f"compile ({args.properties} properties): compiler {compile_times['compiler_init_s'] * 1e3:.1f} ms, "
        f"cold {compile_times['cold_s'] * 1e3:.1f} ms, cached {compile_times['cached_s'] * 1e6:.1f} us"
    )
    print(
        f"decode, batch {args.batch}: {decode['constrained_tokens_per_s']:.1f} tok/s constrained vs "
        f"{decode['unconstrained_tokens_per_s']:.1f} tok/s free, ratio {decode['ratio']:.3f}, "
        f"mask {decode['mask_ms_per_step']:.2f} ms/step ({100 * decode['mask_share']:.1f}% of the time) "
        f"({decode['constrained_completed']}/{args.batch} completed their schema)"
    )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
