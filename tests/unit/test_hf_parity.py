"""Greedy outputs match Hugging Face transformers token for token, whatever the batching.

Each request is generated alone by HF ``generate`` (float32), then all 32 run together
in the engine under different schedules: no chunking, a tiny step budget, a KV pool
small enough to force preemption (recompute and swap), and shared prefixes with the
prefix cache on. Llama and Qwen2 run every schedule; the other families (Qwen3,
Phi-3, Mixtral, Qwen3-MoE, and sliding windows: Mistral's on every layer, Qwen2's on
some, both shorter than most prompts; ``tests.helpers.HF_FAMILIES``) the plain,
chunked, preempting and prefix-caching ones.

Parity only shows something if the reference depends on what the engine could get
wrong. At transformers' default init (std 0.02) it does not: the residual stream is
little more than the last token's embedding, so the tied-embedding Qwen2 model repeats
its last prompt token forever and zeroing attention changes no output; a broken KV
cache, preemption or prefix cache would pass. The checkpoints here use a larger init,
and the reference fixture checks that the outputs depend on attention.
"""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import build_hf_checkpoint

NUM_REQUESTS = 32
# Large enough that attention, not the last token's embedding, decides the outputs.
INIT = dict(initializer_range=0.2)
# Gemma scales its embeddings by sqrt(hidden) and norms each sublayer's output: at 0.2
# its greedy outputs mostly repeat the token before; 0.05 keeps them varied.
FAMILY_INIT = {"gemma3": dict(initializer_range=0.05)}


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


def _hf_model(model_dir, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _hf_greedy(model, prompts, lengths):
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, lengths):
            ids = torch.tensor([prompt], device=model.device)
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


def _first_departures(model, prompts, outputs):
    """Where ``model``'s greedy output would first leave ``outputs``, per request (None: never).

    One forward over prompt + output gives the model's pick at every position; the
    first pick that differs is where its own greedy generation would part.
    """
    departures = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + out[:-1]], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 :]
            picks = logits.argmax(-1).tolist()
            departures.append(next((i for i, (a, b) in enumerate(zip(picks, out)) if a != b), None))
    return departures


def _assert_outputs_depend_on_attention(model, prompts, outputs):
    """A reference that could catch an attention, KV, preemption or prefix-cache bug."""
    blind = copy.deepcopy(model)
    for layer in blind.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
    same = sum(d is None for d in _first_departures(blind, prompts, outputs))
    assert same <= len(prompts) // 4, (
        f"{same} of {len(prompts)} outputs are unchanged with attention zeroed: "
        "the checkpoint is too weak for parity to catch attention or KV bugs"
    )
    _assert_not_degenerate(prompts, outputs)


def _assert_not_degenerate(prompts, outputs, min_distinct_share: float = 0.5):
    """Outputs that vary: many distinct tokens, few that repeat the token before them."""
    total = sum(len(o) for o in outputs)
    distinct = len({t for o in outputs for t in o})
    assert distinct >= min_distinct_share * total, (
        f"{distinct} distinct tokens in {total} generated: the model repeats a few tokens"
    )
    previous = [[p[-1]] + o[:-1] for p, o in zip(prompts, outputs)]
    repeats = sum(t == q for o, prev in zip(outputs, previous) for t, q in zip(o, prev))
    assert repeats <= total // 10, (
        f"{repeats} of {total} generated tokens repeat the token before them: "
        "the model mostly echoes its input"
    )


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def reference(request, tmp_path_factory, default_model):
    return _reference(request.param, tmp_path_factory, default_model)


@pytest.fixture(scope="module", params=["qwen3", "phi3", "mixtral", "qwen3_moe", "mistral", "qwen2_window", "gemma3"])
def family_reference(request, tmp_path_factory, default_model):
    return _reference(request.param, tmp_path_factory, default_model)


def _reference(family: str, tmp_path_factory, default_model) -> dict:
    """A random-weight checkpoint and HF's greedy outputs for two workloads on it."""
    model_dir = build_hf_checkpoint(
        tmp_path_factory.mktemp(family), family, default_model, **FAMILY_INIT.get(family, INIT)
    )
    from engine.model.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    model = _hf_model(model_dir)
    workloads = {"mixed": _workload(vocab, seed=1), "shared": _workload(vocab, seed=2, shared_prefix=200)}
    ref = {"dir": str(model_dir)}
    for name, (prompts, lengths) in workloads.items():
        want = _hf_greedy(model, prompts, lengths)
        _assert_outputs_depend_on_attention(model, prompts, want)
        ref[name] = (prompts, lengths, want)
    return ref


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
    _check_schedule(reference, setting)


@pytest.mark.parametrize("setting", ["no-chunking", "16-token-budget", "preempt-recompute", "preempt-swap"])
def test_other_families_match_hf(family_reference, setting):
    _check_schedule(family_reference, setting)


def test_other_families_match_hf_with_prefix_cache_hits(family_reference):
    test_greedy_matches_hf_with_prefix_cache_hits(family_reference)


def _check_schedule(reference: dict, setting: str) -> None:
    from engine.model.model_config import ModelConfig

    prompts, lengths, want = reference["mixed"]
    got, stats = _run(reference["dir"], prompts, lengths, enable_prefix_caching=False, **SETTINGS[setting])
    _assert_same(got, want)
    mode = SETTINGS[setting].get("preemption_mode")
    if ModelConfig.from_pretrained(reference["dir"]).kv_window:
        # Every layer slides: the blocks behind the window go back as requests run, so a
        # running request needs no more once past it and the pool seldom runs short
        # (preemption with a window: tests/unit/test_window_release.py).
        assert stats.num_window_released_blocks > 0, "the blocks behind the window should have been given back"
    elif mode is not None:  # the setting is there to preempt: parity means little if it did not
        blocks = SETTINGS[setting]["num_kv_blocks"]
        done = {"recompute": stats.num_preemptions_recompute, "swap": stats.num_preemptions_swap}
        assert done[mode] > 0, f"a {blocks}-block pool should force {mode} preemptions; preemptions: {done}"
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks leaked"


def test_greedy_matches_hf_with_prefix_cache_hits(reference):
    prompts, lengths, want = reference["shared"]
    got, stats = _run(reference["dir"], prompts, lengths, max_num_batched_tokens=256)
    _assert_same(got, want)
    assert stats.prefix_cache_hits > 0, "prompts sharing 200-token prefixes should hit the cache"
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks leaked"


def test_other_families_write_what_a_json_schema_a_regex_and_a_tool_choice_allow(family_reference):
    """Structured output on every family's checkpoint: the token masks fit each model's
    own vocabulary width and sampler (Gemma's soft-capped logits, MoE routing, windows);
    a ``required`` tool choice's output (the router's schema) reads as calls that fit
    their functions' parameters."""
    from engine.wire.sampling_params import StructuredOutput
    from tests.helpers import ENGINE_PROMPTS, assert_engine_idle
    from tests.unit.test_structured_output import NESTED, _assert_valid_json, _json_outputs

    llm = LLM(model=family_reference["dir"], num_kv_blocks=256)
    outs = _json_outputs(llm, NESTED)
    _assert_valid_json(outs, NESTED)
    assert len({o.text for o in outs}) > 1, "every prompt gave the same output: was the model consulted?"
    regex = r"[a-z]{3,6}-[0-9]{2}"
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput("regex", regex))
    for out in llm.generate(ENGINE_PROMPTS, params):
        assert re.fullmatch(regex, out.text), out.text

    import json

    import jsonschema  # (not in the GPU image, which imports this module)

    from router.tool_calls import ToolPlan
    from router.tool_parsers import required_schema

    functions = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                 "required": ["city"]},
                 "get_time": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                         "maximum": 14}}, "required": ["zone"]}}
    schema = required_schema([{"name": n, "parameters": p} for n, p in functions.items()], parallel=False)
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=i, structured_output=StructuredOutput.json_schema(schema))
              for i in range(len(ENGINE_PROMPTS))]
    plan = ToolPlan("required", parallel=False, tools=frozenset(functions))
    for out in llm.generate(ENGINE_PROMPTS, params):
        calls = plan.parse(out.text).calls
        assert out.finish_reason == "stop" and calls, f"no calls in {out.text!r} ({out.finish_reason})"
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), functions[call.name])
    assert_engine_idle(llm)
