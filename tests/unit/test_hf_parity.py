"""Greedy outputs match Hugging Face transformers token for token, whatever the batching.

Each request is generated alone by HF ``generate`` (float32), then all 32 run together
in the engine under different schedules: no chunking, a tiny step budget, a KV pool
small enough to force preemption (recompute and swap), and shared prefixes with the
prefix cache on.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import build_hf_checkpoint

NUM_REQUESTS = 32


def _workload(vocab: int, seed: int, shared_prefix: int = 0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(shared_prefix)] for _ in range(4)]
    prompts, lengths = [], []
    for i in range(NUM_REQUESTS):
        if shared_prefix:
            prompt = prefixes[i % 4] + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 300))]
        prompts.append(prompt)
        lengths.append(rng.randint(1, 64))
    return prompts, lengths


def _hf_greedy(model_dir, prompts, lengths):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, lengths):
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def reference(request, tmp_path_factory, default_model):
    """A random-weight checkpoint and HF's greedy outputs for two workloads on it."""
    model_dir = build_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, default_model)
    from engine.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    mixed = _workload(vocab, seed=1)
    shared = _workload(vocab, seed=2, shared_prefix=200)
    return {
        "dir": str(model_dir),
        "mixed": (*mixed, _hf_greedy(model_dir, *mixed)),
        "shared": (*shared, _hf_greedy(model_dir, *shared)),
    }


SETTINGS = {
    "no-chunking": dict(enable_chunked_prefill=False),
    "16-token-budget": dict(max_num_batched_tokens=16),
    "preempt-recompute": dict(num_kv_blocks=48, preemption_mode="recompute"),
    "preempt-swap": dict(num_kv_blocks=48, preemption_mode="swap"),
    "static": dict(batching="static", enable_chunked_prefill=False),
    "static-16-token-chunks": dict(batching="static", max_num_batched_tokens=16),
    "static-preempt-swap": dict(batching="static", num_kv_blocks=48, preemption_mode="swap"),
}


def _run(model_dir, prompts, lengths, **engine_kwargs):
    llm = LLM(model=model_dir, **engine_kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm.stats()


def _assert_same(got, want):
    assert len(got) == len(want), f"{len(got)} outputs for {len(want)} requests"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            pos = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            pytest.fail(f"request {i}: first difference at output token {pos}: engine {g[pos:pos+5]} vs HF {w[pos:pos+5]}")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf_under_each_schedule(reference, setting):
    prompts, lengths, want = reference["mixed"]
    got, stats = _run(reference["dir"], prompts, lengths, enable_prefix_caching=False, **SETTINGS[setting])
    _assert_same(got, want)
    if setting == "preempt-recompute":
        assert stats.num_preemptions_recompute > 0, "a 48-block pool should force recompute preemptions"
    if setting == "preempt-swap":
        assert stats.num_preemptions_swap > 0, "a 48-block pool should force swap preemptions"
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks leaked"


def test_greedy_matches_hf_with_prefix_cache_hits(reference):
    prompts, lengths, want = reference["shared"]
    got, stats = _run(reference["dir"], prompts, lengths, max_num_batched_tokens=256)
    _assert_same(got, want)
    assert stats.prefix_cache_hits > 0, "prompts sharing 200-token prefixes should hit the cache"
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks leaked"
