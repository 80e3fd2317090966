"""The engine's public API on the built-in small model: ``LLM.generate`` and the
step-wise ``LLMEngine`` (add_request / step / abort / stats).

One engine serves the whole module; every test leaves it idle with no KV blocks held.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.wire.sampling_params import MAX_LOGPROBS

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The cat sat on the", "Hello world, this is a longer prompt than the others"]


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    return LLM(model=str(default_model), num_kv_blocks=256)


def _assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks still held"
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0), (
        f"requests left behind: {stats}"
    )
    assert not llm.engine.has_unfinished_requests()


def _greedy(llm: LLM, prompt, max_tokens: int = 24):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))[0]


# ------------------------------------------------------------------ validation


def _bad_inputs(vocab: int, max_len: int):
    return {
        "empty-text": ("", {}, "prompt"),
        "empty-ids": ([], {}, "prompt"),
        "too-long": ([5] * max_len, {}, "max_model_len"),
        "id-too-big": ([1, vocab], {}, "prompt_token_ids"),
        "id-negative": ([-1, 3], {}, "prompt_token_ids"),
        "max_tokens-0": ("hi", dict(max_tokens=0), "max_tokens"),
        "temperature-negative": ("hi", dict(temperature=-0.5), "temperature"),
        "top_p-0": ("hi", dict(top_p=0.0), "top_p"),
        "top_p-1.5": ("hi", dict(top_p=1.5), "top_p"),
        "logprobs-21": ("hi", dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    }


BAD_CASES = list(_bad_inputs(1, 1))


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_value_error_naming_the_field_and_the_engine_carries_on(llm, case):
    vocab = llm.engine.model_config.vocab_size
    prompt, params, field = _bad_inputs(vocab, llm.engine.max_model_len)[case]
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], SamplingParams(**params))  # a batch of one: [] alone is no prompts
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request(prompt, SamplingParams(**params))
    _assert_idle(llm)
    out = _greedy(llm, "a normal request", max_tokens=3)
    assert len(out.token_ids) == 3 and out.finish_reason == "length", (
        "after rejecting bad input the engine must still serve a normal request"
    )
    _assert_idle(llm)


def test_longest_allowed_prompt_is_one_below_max_model_len(llm):
    max_len = llm.engine.max_model_len
    assert len(llm.engine.encode_prompt([5] * (max_len - 1))) == max_len - 1
    with pytest.raises(ValueError, match="max_model_len"):
        llm.engine.encode_prompt([5] * max_len)


def test_a_batch_with_one_bad_prompt_queues_nothing(llm):
    steps = llm.stats().num_steps
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=2))
    assert llm.stats().num_steps == steps, "nothing may run when any prompt is rejected"
    _assert_idle(llm)


# ------------------------------------------------------------------ generate


def test_outputs_come_back_in_prompt_order(llm):
    lengths = [9, 1, 5]  # finish in the order 2nd, 3rd, 1st
    alone = [_greedy(llm, p, n).token_ids for p, n in zip(PROMPTS, lengths)]
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths])
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in PROMPTS], (
        "output i must belong to prompt i"
    )
    assert [o.token_ids for o in outs] == alone, "batched greedy output must equal each run alone"
    assert [len(o.token_ids) for o in outs] == lengths
    _assert_idle(llm)


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=50, seed=9, max_tokens=5, ignore_eos=True),
    ]
    together = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others[0], params, others[1]]
    )[1].token_ids
    assert together == alone, "a seeded request must not depend on its batch mates"
    other_seed = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True))
    assert other_seed[0].token_ids != alone, "a different seed should give different tokens"
    _assert_idle(llm)


def _stop_string(text: str) -> tuple[str, int]:
    """A 2-character piece of ``text`` whose first occurrence is not at the start
    (and not a U+FFFD stand-in for a partial character)."""
    for k in range(len(text) // 3, len(text) - 2):
        s = text[k : k + 2]
        i = text.find(s)
        if i > 0 and s.strip() and "\ufffd" not in s:
            return s, i
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text_right_before_it(llm):
    full = _greedy(llm, PROMPTS[2], max_tokens=24)
    stop, i = _stop_string(full.text)
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0]
    assert out.text == full.text[:i], f"stop {stop!r}: expected {full.text[:i]!r}, got {out.text!r}"
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24, (
        "generation stops at the token that completes the stop string"
    )
    _assert_idle(llm)


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    full = _greedy(llm, PROMPTS[2], max_tokens=24)
    stop, i = _stop_string(full.text)
    params = SamplingParams(max_tokens=24, stop=[stop], include_stop_str_in_output=True, **GREEDY)
    out = llm.generate(PROMPTS[2], params)[0]
    assert out.text == full.text[: i + len(stop)], f"expected the text through {stop!r}, got {out.text!r}"
    assert out.finish_reason == "stop"
    _assert_idle(llm)


def test_stop_token_ids_end_generation_at_that_token(llm):
    full = _greedy(llm, PROMPTS[1], max_tokens=16).token_ids
    stop_id = full[3]
    j = full.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.token_ids == full[: j + 1], f"expected to stop after token {j} ({stop_id})"
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    _assert_idle(llm)


def test_max_tokens_ends_with_finish_reason_length(llm):
    out = _greedy(llm, PROMPTS[0], max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None
    _assert_idle(llm)


def test_logprobs_are_returned_when_asked(llm):
    params = SamplingParams(max_tokens=4, logprobs=3, **GREEDY)
    out = llm.generate(PROMPTS[0], params)[0]
    assert out.logprobs is not None and len(out.logprobs) == 4, "one entry per generated token"
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == tok and lp.logprob == pytest.approx(values[0]), (
            "a greedy token is the most likely one"
        )
        assert lp.logprob <= 0
    assert _greedy(llm, PROMPTS[0], max_tokens=2).logprobs is None, "no logprobs unless asked"
    _assert_idle(llm)


# ------------------------------------------------------------------ step-wise API


def test_step_api_streams_deltas_that_add_up_to_the_final_output(llm):
    engine = llm.engine
    before = engine.stats()
    params = {"a": SamplingParams(max_tokens=6, **GREEDY), "b": SamplingParams(max_tokens=3, **GREEDY)}
    for rid, prompt in zip(params, PROMPTS):
        assert engine.add_request(prompt, params[rid], request_id=rid) == rid
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", request_id="a")
    assert engine.stats().num_waiting == 2
    streamed = {rid: ([], []) for rid in params}
    final = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in final, f"{out.request_id} produced output after finishing"
            streamed[out.request_id][0].extend(out.new_token_ids)
            streamed[out.request_id][1].append(out.new_text)
            if out.finished:
                final[out.request_id] = out
    assert sorted(final) == ["a", "b"], "each request ends with exactly one finished output"
    for rid, out in final.items():
        ids, texts = streamed[rid]
        assert ids == out.token_ids, f"{rid}: token deltas must add up to the final token ids"
        assert "".join(texts) == out.text, f"{rid}: text deltas must add up to the final text"
        assert len(out.token_ids) == params[rid].max_tokens and out.finish_reason == "length"
    after = engine.stats()
    assert after.num_steps - before.num_steps == 6, "6 steps: 1 prefill + 5 decodes for the longer one"
    assert after.generation_tokens - before.generation_tokens == 9
    assert after.prompt_tokens - before.prompt_tokens == sum(
        len(llm.tokenizer.encode(p)) for p in PROMPTS[:2]
    )
    _assert_idle(llm)


def test_abort_frees_a_running_and_a_waiting_request(llm):
    engine = llm.engine
    running = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=200, **GREEDY))
    engine.step()
    engine.step()
    assert engine.stats().num_blocks_in_use > 0 and engine.stats().num_running == 1
    waiting = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=200, **GREEDY))
    assert engine.stats().num_waiting == 1
    engine.abort([running, waiting, "no-such-request"])
    _assert_idle(llm)
    assert engine.step() == [], "aborted requests produce no more output"
    _assert_idle(llm)


@pytest.mark.parametrize("policy, order", [("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"])])
def test_waiting_requests_run_in_the_policys_order_lowest_priority_value_first(default_model, policy, order):
    from engine import LLMEngine

    engine = LLMEngine(model=str(default_model), num_kv_blocks=64, max_num_seqs=1, policy=policy)
    params = SamplingParams(max_tokens=2, **GREEDY)
    engine.add_request(PROMPTS[0], params, request_id="first", priority=9)
    engine.step()  # "first" runs; one at a time, the others wait behind it
    for rid, priority in (("a", 0), ("b", 5), ("c", -1)):
        engine.add_request(PROMPTS[1], params, request_id=rid, priority=priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["first", *order], f"{policy}: finished in the order {finished}"
    assert engine.stats().num_blocks_in_use == 0


def test_a_request_that_outgrows_a_small_kv_pool_finishes_with_length(default_model):
    small = LLM(model=str(default_model), num_kv_blocks=3)  # 2 usable blocks of 16 tokens
    engine = small.engine
    rid = engine.add_request(list(range(20, 40)), SamplingParams(max_tokens=40, **GREEDY))
    final = None
    for _ in range(60):
        if not engine.has_unfinished_requests():
            break
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and final.request_id == rid, (
        "a request ended for lack of KV space must still get a finished output"
    )
    assert final.finish_reason == "length"
    assert 20 + len(final.token_ids) == 33, "it generates until the 32-token pool is full"
    _assert_idle(small)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engine_runs_in_that_dtype_and_matches_hf_first_tokens(tmp_path, default_model, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import build_hf_checkpoint

    ckpt = build_hf_checkpoint(tmp_path, "llama", default_model, seed=11)
    llm = LLM(model=str(ckpt), dtype=dtype, num_kv_blocks=32)
    assert {p.dtype for p in llm.engine.model.parameters()} == {getattr(torch, dtype)}
    prompt = [5, 17, 300, 42, 7, 99, 1000, 3]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))[0]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
    # Half precision may round two near-equal logits either way; the pick must be a top one.
    assert logits[out.token_ids[0]] >= logits.max() - 2e-2 * logits.abs().max()
    assert llm.stats().num_blocks_in_use == 0


# ------------------------------------------------------------------ resumed (migrated) requests


def _run_to_end(llm: LLM, prompt_ids, params, resume=()):
    rid = llm.engine.add_request(prompt_ids, params, resume_output=resume)
    ids, text, final = [], "", None
    text_after = {}  # tokens so far -> text streamed so far
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.request_id == rid
            ids += out.new_token_ids
            text += out.new_text
            text_after[len(ids)] = text
            final = out
    return ids, text, final, text_after


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=50, seed=11, presence_penalty=0.5)]
)
def test_a_resumed_request_continues_exactly_where_its_tokens_stop(llm, sampling):
    prompt = llm.engine.encode_prompt(PROMPTS[2])
    params = SamplingParams(max_tokens=20, ignore_eos=True, **sampling)
    full_ids, full_text, _, text_after = _run_to_end(llm, prompt, params)
    for k in (1, 7, 19):
        ids, text, final, _ = _run_to_end(llm, prompt, params, resume=full_ids[:k])
        assert ids == full_ids[k:], f"resumed after {k} tokens: expected {full_ids[k:]}, got {ids}"
        assert text_after[k] + text == full_text, "the resumed text must continue the streamed text exactly"
        assert final.num_output_tokens == 20 and final.finish_reason == "length"
    _assert_idle(llm)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=50, seed=11, presence_penalty=0.5)]
)
def test_a_stream_migrated_through_a_prefill_engine_continues_on_a_new_decode_engine(llm, default_model, sampling):
    """The disaggregated migration: a prefill engine computes the KV of the prompt plus the
    tokens already streamed and samples the next one; a decode engine takes that KV and
    goes on. Every token after the split equals the undisturbed run's."""
    from engine import LLMEngine

    prompt = llm.engine.encode_prompt(PROMPTS[2] * 3)  # several blocks: the prefix cache serves them
    params = SamplingParams(max_tokens=20, ignore_eos=True, **sampling)
    full_ids, full_text, _, text_after = _run_to_end(llm, prompt, params)
    decode = LLMEngine(model=str(default_model), num_kv_blocks=64)
    for k in (1, 7, 19):
        rid = f"migrated-{k}"
        first_params = SamplingParams(**{**vars(params), "max_tokens": k + 1})
        llm.engine.add_request(prompt, first_params, request_id=rid, hold_kv=True, resume_output=full_ids[:k])
        first = None
        while first is None:
            first = next((o for o in llm.engine.step() if o.finished), None)
        assert first.token_ids == full_ids[: k + 1], f"after {k} tokens the prefill engine sampled {first.token_ids}"
        assert first.num_cached_tokens >= 16, "the prompt's blocks came from the prefix cache"
        kv = llm.engine.take_held_kv(rid, first.kv_blocks)
        assert kv[0].shape[1] == -(-(len(prompt) + k) // 16), "the KV of the prompt and the resumed tokens"
        assert decode.add_remote_request(prompt, params, request_id=rid, resume_output=full_ids[:k]) is not None
        outs = [decode.remote_kv_arrived(rid, first.token_ids[-1], *kv)]
        while decode.has_unfinished_requests():
            outs += decode.step()
        ids = [t for o in outs if o is not None for t in o.new_token_ids]
        text = "".join(o.new_text for o in outs if o is not None)
        assert ids == full_ids[k:], f"migrated after {k} tokens: expected {full_ids[k:]}, got {ids}"
        assert text_after[k] + text == full_text
        assert decode.stats().num_blocks_in_use == 0
    _assert_idle(llm)


def test_a_decode_engine_holds_the_blocks_of_a_prompt_it_received_before(llm, default_model):
    """Disaggregated prefix caching: reserving a prompt a second time takes its full blocks
    from the decode engine's own prefix cache, so only the blocks after them are sent,
    and the output is the same."""
    from engine import LLMEngine

    prompt = llm.engine.encode_prompt(PROMPTS[1] * 4)
    params = SamplingParams(max_tokens=6, **GREEDY)
    decode = LLMEngine(model=str(default_model), num_kv_blocks=64)
    runs = []
    for rid in ("first", "second"):
        llm.engine.add_request(prompt, SamplingParams(**{**vars(params), "max_tokens": 1}), request_id=rid, hold_kv=True)
        first = None
        while first is None:
            first = next((o for o in llm.engine.step() if o.finished), None)
        blocks, held = decode.add_remote_request(prompt, params, request_id=rid)
        k, v = (t[:, held:] for t in llm.engine.take_held_kv(rid, first.kv_blocks))  # what a prefill worker sends
        outs = [decode.remote_kv_arrived(rid, first.token_ids[-1], k, v)]
        while decode.has_unfinished_requests():
            outs += decode.step()
        runs.append(([t for o in outs if o is not None for t in o.new_token_ids], blocks, held))
    (ids, blocks, held), (again, blocks_again, held_again) = runs
    assert held == 0 and held_again == (len(prompt) - 1) // 16, (held, held_again, len(prompt))
    assert blocks_again[:held_again] == blocks[:held_again], "the held blocks are the first request's"
    assert again == ids, "the same greedy output from the held blocks"
    with pytest.raises(ValueError, match="blocks of KV"):
        decode.add_remote_request(prompt, params, request_id="wrong")
        decode.remote_kv_arrived("wrong", 0, k[:, 1:], v[:, 1:])
    decode.abort(["wrong"])
    assert decode.stats().num_blocks_in_use == 0
    _assert_idle(llm)


# ------------------------------------------------------------------ load reports


def test_load_counts_running_waiting_queued_tokens_and_requests_waiting_for_kv(llm):
    engine = llm.engine
    free = engine.load().num_free_blocks
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request(PROMPTS[0], params, request_id="local")
    prompt = engine.encode_prompt(PROMPTS[1])
    reserved = engine.add_remote_request(prompt, params, request_id="remote")
    load = engine.load()
    local_tokens = len(engine.encode_prompt(PROMPTS[0]))
    assert (load.num_running, load.num_waiting, load.num_waiting_for_kv) == (0, 1, 1), load
    assert engine.num_queued_tokens() == local_tokens + len(prompt), "both prompts are still to be computed"
    assert load.num_free_blocks == free - len(reserved[0]), "the reservation's blocks are taken"
    assert engine.is_waiting_for_kv("remote") and not engine.is_waiting_for_kv("local")
    engine.step()
    assert engine.load().num_running == 1 and engine.load().num_waiting == 0
    engine.abort(["local", "remote"])
    assert not engine.is_waiting_for_kv("remote")
    _assert_idle(llm)
