"""The ``tandem`` command: make the default model, generate offline, run benchmarks."""

from __future__ import annotations

import argparse
import sys


def _cmd_make_model(args: argparse.Namespace) -> int:
    from engine.default_model import make_model

    path = make_model(args.dir, seed=args.seed)
    print(f"wrote {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    (out,) = llm.generate([prompt], params)
    print(out.text)
    stats = llm.stats()
    print(
        f"[{out.num_prompt_tokens} prompt tokens, {len(out.token_ids)} generated, "
        f"finish_reason={out.finish_reason}, blocks in use after: {stats.num_blocks_in_use}]",
        file=sys.stderr,
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "offline":
        from bench.offline import main as offline_main

        return offline_main(args.rest)
    raise SystemExit(f"unknown benchmark {args.bench!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write the deterministic default checkpoint to DIR")
    mm.add_argument("dir")
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(func=_cmd_make_model)

    gen = sub.add_parser("generate", help="generate a completion offline")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF checkpoint dir (default: built-in model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--num-kv-blocks", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="run a benchmark program (offline)")
    bench.add_argument("bench", choices=["offline"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
