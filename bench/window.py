"""KV blocks a long prompt holds on a model whose every layer slides, against the same
model attending to its whole context (``python -m bench.window``).

Builds two random-weight Mistral-shaped checkpoints with transformers, one with
``sliding_window`` = ``--window`` and one without, and reports for one ``--prompt``-token
prompt:

- one engine (colocated, or a prefill worker): the blocks the request holds between
  steps, at most and once its prompt is in (chunked prefill of ``--chunk`` tokens);
- a decode worker receiving the prompt's KV from a prefill worker: the blocks it
  reserves and how many of them are sent (``add_remote_request``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine import LLMEngine, SamplingParams


def build_checkpoint(out: Path, window: int, context: int) -> Path:
    """A small Mistral-shaped checkpoint; ``window`` 0: every layer reads the whole context."""
    from transformers import MistralConfig, MistralForCausalLM

    from engine.model.default_model import ensure_default_model

    tokenizer = ensure_default_model()
    vocab = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    config = MistralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                           sliding_window=window or None, bos_token_id=None, eos_token_id=None)
    MistralForCausalLM(config).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / f, out / f)
    return out


def measure(model: Path, prompt: list[int], chunk: int, output: int, num_blocks: int) -> dict:
    """The blocks one request holds on each side (see the module docstring)."""
    engine = LLMEngine(model=str(model), num_kv_blocks=num_blocks, max_num_batched_tokens=chunk,
                       enable_prefix_caching=False)
    engine.add_request(prompt, SamplingParams(max_tokens=output, ignore_eos=True))
    peak, after_prompt = 0, None
    while engine.has_unfinished_requests():
        engine.step()
        used = engine.kv_manager.pool.num_used_blocks
        peak = max(peak, used)
        if after_prompt is None and all(r.num_computed_tokens >= len(prompt) for r in engine.scheduler.running):
            after_prompt = used
    reservation = engine.add_remote_request(prompt, SamplingParams(max_tokens=output, ignore_eos=True),
                                            request_id="remote")
    if reservation is None:
        raise SystemExit(f"{num_blocks} blocks do not hold the prompt on the decode side")
    table, not_sent = reservation
    reserved = engine.kv_manager.pool.num_used_blocks
    engine.abort("remote")
    return {"peak": peak, "after_prompt": after_prompt, "reserved": reserved, "sent": len(table) - not_sent}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    p.add_argument("--window", type=int, default=1024, help="every layer's window")
    p.add_argument("--chunk", type=int, default=512, help="chunked-prefill token budget")
    p.add_argument("--output", type=int, default=64, help="output tokens")
    args = p.parse_args(argv)
    prompt = [(7 * i) % 4000 + 3 for i in range(args.prompt)]
    context = 1 << (args.prompt + args.output).bit_length()
    num_blocks = 2 * (context // 16) + 8
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for window in (0, args.window):
            model = build_checkpoint(Path(tmp) / f"w{window}", window, context)
            rows[window] = measure(model, prompt, args.chunk, args.output, num_blocks)
    print(f"{args.prompt}-token prompt, blocks of 16, {args.chunk}-token chunks, {args.output} tokens out")
    print(f"{'':24} {'whole context':>14} {f'window {args.window}':>14}")
    whole, window = rows[0], rows[args.window]
    for key, label in (("peak", "held between steps, max"), ("after_prompt", "held after the prompt"),
                       ("reserved", "decode side: reserved"), ("sent", "decode side: sent")):
        print(f"{label:24} {whole[key]:>14} {window[key]:>14}   {whole[key] / window[key]:.1f}x")


if __name__ == "__main__":
    main()
