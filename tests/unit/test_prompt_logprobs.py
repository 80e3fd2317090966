"""Prompt logprobs (vLLM's ``prompt_logprobs``) match Hugging Face transformers.

For each prompt token after the first, the engine's logprob of that token given the ones
before it, its rank and the top tokens equal those of one HF forward over the prompt
(float32), whether the prompt is computed whole, in 16-token chunks, after a shared
prefix sits in the prefix cache, or through recompute preemptions. They come once, with
the request's first output.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from tests.helpers import assert_engine_idle, build_hf_checkpoint

TOP = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model):
    return build_hf_checkpoint(tmp_path_factory.mktemp("plp"), "llama", default_model, initializer_range=0.2)


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _prompts(vocab: int, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(3)
    lengths = [1, 2, 17, 40, 95, 130]
    return [list(prefix) + [rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def _assert_matches_hf(hf, prompt: list[int], got: list, top: int = TOP) -> None:
    assert got is not None, "no prompt_logprobs on the output"
    assert len(got) == len(prompt), f"{len(got)} entries for a {len(prompt)}-token prompt"
    assert got[0] is None, f"the first prompt token has no logprob, got {got[0]}"
    if len(prompt) == 1:
        return
    want = _hf_prompt_logprobs(hf, prompt)
    for p, entry in enumerate(got[1:]):
        row = want[p]
        assert entry.token_id == prompt[p + 1], f"position {p + 1}: scored token {entry.token_id}"
        assert abs(entry.logprob - row[prompt[p + 1]].item()) < TOL, (
            f"position {p + 1}: logprob {entry.logprob} vs HF {row[prompt[p + 1]].item()}"
        )
        assert entry.rank == int((row > row[prompt[p + 1]]).sum()) + 1, f"position {p + 1}: rank {entry.rank}"
        vals, ids = row.topk(top)
        assert [t for t, _ in entry.top] == ids.tolist(), f"position {p + 1}: top ids differ from HF"
        assert max(abs(a - b) for (_, a), b in zip(entry.top, vals.tolist())) < TOL


SETTINGS = {
    "whole-prompts": dict(enable_chunked_prefill=False),
    "16-token-chunks": dict(max_num_batched_tokens=16),
    "preempt-recompute": dict(num_kv_blocks=20, preemption_mode="recompute", max_num_batched_tokens=32),
}
MAX_TOKENS = {"preempt-recompute": 60}  # outputs outgrow the 20-block pool


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prompt_logprobs_match_hf(checkpoint, hf, setting):
    llm = LLM(model=str(checkpoint), **SETTINGS[setting])
    prompts = _prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(
        max_tokens=MAX_TOKENS.get(setting, 8), temperature=0.0, ignore_eos=True, prompt_logprobs=TOP
    )
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        _assert_matches_hf(hf, prompt, out.prompt_logprobs)
    if "preemption_mode" in SETTINGS[setting]:
        assert llm.stats().num_preemptions_recompute > 0, "the small pool should force recompute preemptions"
    assert_engine_idle(llm)


def test_prompt_logprobs_skip_the_prefix_cache_but_leave_it_for_others(checkpoint, hf):
    llm = LLM(model=str(checkpoint), max_num_batched_tokens=64)
    vocab = llm.engine.model_config.vocab_size
    prefix = [random.Random(5).randrange(vocab) for _ in range(64)]
    prompts = _prompts(vocab, prefix)[2:]
    llm.generate([prefix + [1]], SamplingParams(max_tokens=1))  # the shared prefix is now cached
    hits = llm.stats().prefix_cache_hits
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.num_cached_tokens == 0, "a request with prompt_logprobs must compute its whole prompt"
        _assert_matches_hf(hf, prompt, out.prompt_logprobs)
    assert llm.stats().prefix_cache_hits == hits
    llm.generate(prompts[:1], SamplingParams(max_tokens=1))
    assert llm.stats().prefix_cache_hits > hits, "the prompt_logprobs requests' blocks should stay cached"
    assert_engine_idle(llm)


def test_prompt_logprobs_come_once_with_the_first_output(checkpoint):
    engine = LLMEngine(model=str(checkpoint), max_num_batched_tokens=16)
    prompt = list(range(3, 60))
    engine.add_request(prompt, SamplingParams(max_tokens=4, prompt_logprobs=0, logprobs=1))
    engine.add_request(prompt, SamplingParams(max_tokens=4), request_id="plain")
    seen = {"plain": [], "req-0": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    first, *rest = [o for o in seen["req-0"] if o.new_token_ids]
    assert len(first.prompt_logprobs) == len(prompt) and all(lp.top == () for lp in first.prompt_logprobs[1:])
    assert all(o.prompt_logprobs is None for o in rest + seen["plain"]), "prompt_logprobs sent more than once"


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_names_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_travel_from_the_prefill_engine_to_the_decode_engines_first_delta(checkpoint, hf):
    """Disaggregated: the prefill engine computes them, the decode engine's first output
    (and its wire delta to the router) carries them."""
    from decode_worker.worker import _wire
    from engine.wire.messages import StreamDelta

    prompt = _prompts(4096)[4]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prefill = LLMEngine(model=str(checkpoint), max_num_batched_tokens=32)
    prefill.add_request(prompt, SamplingParams(**{**vars(params), "max_tokens": 1}), "r", hold_kv=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.finished), None)
    _assert_matches_hf(hf, prompt, first.prompt_logprobs, top=2)
    decode = LLMEngine(model=str(checkpoint), num_kv_blocks=64)
    assert decode.add_remote_request(prompt, params, request_id="r") is not None
    kv = prefill.take_held_kv("r", first.kv_blocks)
    outs = [decode.remote_kv_arrived("r", first.token_ids[-1], *kv, None, 0, first.prompt_logprobs)]
    while decode.has_unfinished_requests():
        outs += decode.step()
    assert outs[0].prompt_logprobs is first.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:]), "prompt_logprobs sent more than once"
    delta = StreamDelta._make(_wire("r", outs[:1]))
    assert delta.prompt_logprobs[0] is None and len(delta.prompt_logprobs) == len(prompt)
    lp = first.prompt_logprobs[1]
    assert delta.prompt_logprobs[1] == (lp.token_id, lp.logprob, lp.rank, list(lp.top))
    assert StreamDelta._make(_wire("r", outs[1:2])).prompt_logprobs is None
    assert decode.stats().num_blocks_in_use == 0 and prefill.stats().num_blocks_in_use == 0
