"""Mixture-of-experts decode steps: the grouped experts against a per-token loop over
them, and against a dense model with the same active parameters.

    python -m bench.moe [--hidden 512] [--experts 8] [--top-k 2] [--expert-size 512]
                        [--layers 4] [--context 128] [--batches 1,8,32] [--steps 20]

Builds two random-weight checkpoints with transformers: a Qwen3-MoE (``--experts``
experts of ``--expert-size``, each token to ``--top-k`` of them) and a dense Qwen3
whose MLP is ``top-k x expert-size`` wide, so both compute the same multiply-adds per
token. Three engines run decode steps at each batch size, taking turns so that a slow
spell of the machine hits all of them: the MoE model as the engine runs it (experts
grouped, ``engine/model/moe.py``), the same model with every sparse layer running
``SparseMoE.per_token_reference`` (one token and one expert at a time), and the dense
model. Reported per batch: step times, ``per_token_over_grouped`` and
``grouped_over_dense``. The grouped and per-token engines must agree token for token in
float32; in bfloat16 (``--device cuda``: the fused Triton experts) the two sum in another
order, which may break a near-tie the other way, so the share that agrees is reported.

    python -m bench.moe --device cuda --attention-backend triton --hidden 1024 \
        --expert-size 768 --layers 8 --batches 1,8,32,128 --context 256
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.common import add_engine_arguments, engine_overrides
from bench.steps import decode_kv_blocks, step_times
from engine import LLMEngine, SamplingParams
from engine.model.moe import SparseMoE


def build_checkpoints(out: Path, hidden: int, experts: int, top_k: int, expert_size: int, layers: int
                      ) -> tuple[Path, Path]:
    """(the MoE checkpoint, the dense one with the same active parameters)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.model.default_model import ensure_default_model

    tokenizer = ensure_default_model()
    vocab = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=max(1, hidden // 256), head_dim=64, max_position_embeddings=4096,
                  bos_token_id=None, eos_token_id=None, initializer_range=0.1)
    models = {
        "moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, intermediate_size=top_k * expert_size, moe_intermediate_size=expert_size,
            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        )),
        "dense": Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=top_k * expert_size)),
    }
    dirs = []
    for name, model in models.items():
        path = out / name
        model.save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / f, path / f)
        dirs.append(path)
    return dirs[0], dirs[1]


def per_token_experts(engine: LLMEngine) -> int:
    """Switch every sparse layer of ``engine``'s model to the per-token loop; how many."""
    layers = [m for m in engine.model.modules() if isinstance(m, SparseMoE)]
    for moe in layers:
        moe.forward = moe.per_token_reference
    return len(layers)


AGREEMENT_PROMPTS = 4  # greedy runs the grouped and per-token engines are compared on


def same_tokens(a: LLMEngine, b: LLMEngine, vocab: int, num_prompts: int = AGREEMENT_PROMPTS) -> int:
    """How many of ``num_prompts`` greedy runs ``a`` and ``b`` generate alike."""
    prompts = [[(7 * i + j) % vocab for j in range(20 + 9 * i)] for i in range(num_prompts)]
    outs = []
    for engine in (a, b):
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), request_id=f"c{i}")
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outs.append([done[f"c{i}"] for i in range(len(prompts))])
    return sum(x == y for x, y in zip(*outs))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (workers use 1)")
    add_engine_arguments(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    num_kv_blocks = decode_kv_blocks(max(batches), args.context)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-moe-") as tmp:
        moe_dir, dense_dir = build_checkpoints(
            Path(tmp), args.hidden, args.experts, args.top_k, args.expert_size, args.layers
        )
        grouped, per_token, dense = (LLMEngine(model=str(d), num_kv_blocks=num_kv_blocks, **engine_overrides(args))
                                     for d in (moe_dir, moe_dir, dense_dir))
    if per_token_experts(per_token) == 0:
        raise SystemExit("the MoE checkpoint has no sparse layers")
    agree = same_tokens(grouped, per_token, grouped.model.config.vocab_size)
    n = AGREEMENT_PROMPTS
    if agree < n and grouped.kv_cache.k.dtype == torch.float32:
        raise SystemExit(f"grouped and per-token experts disagree on {n - agree} of {n} greedy runs")
    print(f"grouped and per-token experts agree on {agree} of {n} greedy runs")
    rows = []
    for b in batches:  # the engines take turns
        g, p, d = (step_times(e, [b], args.context, args.steps)[0]["step_ms"] for e in (grouped, per_token, dense))
        row = {"batch": b, "grouped_ms": g, "per_token_ms": p, "dense_ms": d,
               "per_token_over_grouped": round(p / g, 2), "grouped_over_dense": round(g / d, 2)}
        rows.append(row)
        print(f"batch {b:3d}: grouped {g:8.2f} ms, per-token {p:8.2f} ms ({row['per_token_over_grouped']:.2f}x), "
              f"dense {d:8.2f} ms (grouped {row['grouped_over_dense']:.2f}x of it)")
    print(json.dumps(rows))
    assert all(e.stats().num_blocks_in_use == 0 for e in (grouped, per_token, dense))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
