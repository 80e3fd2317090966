"""Structured output on the offline engine: JSON schemas, regexes, choices and EBNF
grammars constrain what a random-weight model writes, in any batch, chunking or
preemption history, and leave unconstrained requests as they were.

Every engine ends each test idle with no KV blocks held.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.grammar import GrammarLimits, check
from engine.model.sampler import apply_token_bitmask
from engine.wire.sampling_params import StructuredOutput
from tests.helpers import ENGINE_PROMPTS, assert_engine_idle, build_hf_checkpoint

try:
    import jsonschema
except ImportError:  # checked by hand below
    jsonschema = None

PROMPTS = ENGINE_PROMPTS

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
            },
            "required": ["zip", "city"],
        },
    },
    "required": ["name", "address"],
}
ENUMS = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}, "n": {"type": "null"}},
    "required": ["color", "ok", "n"],
}
ARRAYS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    },
    "required": ["tags", "scores"],
}
SCHEMAS = {"nested": NESTED, "enums": ENUMS, "arrays": ARRAYS}
REGEXES = [r"[a-z]{3,6}-[0-9]{2}", r"(yes|no|maybe)!?", r"\d{3}-\d{4}"]
CHOICES = ["alpha", "beta gamma", "δέλτα", 'say "hi"']


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(model=tiny_model, num_kv_blocks=256)


def _params(so: StructuredOutput, i: int, max_tokens: int = 120) -> SamplingParams:
    # Half greedy, half sampled with a seed: the random model walks different paths.
    if i % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured_output=so)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=so)


def _validate(value, schema: dict) -> None:
    """``value`` matches ``schema`` (the keywords the schemas above use)."""
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema["type"]
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (value, schema)
        return
    assert isinstance(value, types[kind]), (value, kind)
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value), (value, schema)
        for key, item in value.items():
            _validate(item, schema["properties"][key])
    elif kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), value
        for item in value:
            _validate(item, schema["items"])
    elif kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), value


def _json_outputs(llm, schema, prompts=PROMPTS):
    so = StructuredOutput.json_schema(schema)
    return llm.generate(prompts, [_params(so, i) for i in range(len(prompts))])


def _assert_valid_json(outs, schema) -> None:
    for out in outs:
        assert out.finish_reason == "stop", f"{out.finish_reason!r} after {out.text!r}: the grammar never completed"
        try:
            value = json.loads(out.text)
        except ValueError as e:
            raise AssertionError(f"not JSON: {out.text!r} ({e})") from None
        _validate(value, schema)


# ------------------------------------------------------------------ the kinds


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_parse_and_validate_for_every_prompt(llm, name):
    outs = _json_outputs(llm, SCHEMAS[name])
    _assert_valid_json(outs, SCHEMAS[name])
    assert len({o.text for o in outs}) > 1, "every prompt gave the same output: was the model consulted?"
    assert_engine_idle(llm)


def test_json_object_outputs_are_json_objects(llm):
    so = StructuredOutput("json_object")
    outs = llm.generate(PROMPTS[:6], [_params(so, i, max_tokens=200) for i in range(6)])
    for out in outs:
        if out.finish_reason == "length":  # any object may be longer than the budget
            continue
        assert isinstance(json.loads(out.text), dict), out.text
    assert any(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert_engine_idle(llm)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch_the_regex(llm, pattern):
    so = StructuredOutput("regex", pattern)
    outs = llm.generate(PROMPTS, [_params(so, i, max_tokens=40) for i in range(len(PROMPTS))])
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        assert re.fullmatch(pattern, out.text), f"{out.text!r} does not match {pattern!r}"
    assert_engine_idle(llm)


def test_choice_outputs_are_one_of_the_choices(llm):
    so = StructuredOutput.choice(CHOICES)
    outs = llm.generate(PROMPTS, [_params(so, i, max_tokens=30) for i in range(len(PROMPTS))])
    for out in outs:
        assert out.finish_reason == "stop" and out.text in CHOICES, (out.finish_reason, out.text)
    assert_engine_idle(llm)


def test_ebnf_grammar_outputs_follow_the_grammar(llm):
    grammar = 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [a-z] [a-z]? [a-z]?'
    so = StructuredOutput("grammar", grammar)
    outs = llm.generate(PROMPTS, [_params(so, i, max_tokens=30) for i in range(len(PROMPTS))])
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        assert re.fullmatch(r"(hi|hello) [a-z]{1,3}", out.text), out.text
    assert_engine_idle(llm)


def test_unconstrained_model_does_not_write_these_formats_by_itself(llm):
    # What makes the tests above able to fail: without the mask the random model writes noise.
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert not any(re.fullmatch(REGEXES[0], o.text) for o in outs)
    assert not any(o.text in CHOICES for o in outs)


# ------------------------------------------------------------------ batch mates, chunking, preemption


def test_unconstrained_greedy_outputs_are_unchanged_by_constrained_batch_mates(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:4], plain)
    so = StructuredOutput.json_schema(NESTED)
    mixed = llm.generate(PROMPTS[:4] + PROMPTS[4:8], [plain] * 4 + [_params(so, i) for i in range(4)])
    for a, m in zip(alone, mixed[:4]):
        assert a.token_ids == m.token_ids, f"{a.text!r} became {m.text!r} next to constrained requests"
    _assert_valid_json(mixed[4:], NESTED)
    assert_engine_idle(llm)


def test_chunked_prefill_with_a_small_budget_gives_the_same_valid_outputs(llm, tiny_model):
    small = LLM(model=tiny_model, num_kv_blocks=256, max_num_batched_tokens=8)
    reference = _json_outputs(llm, ARRAYS)
    chunked = _json_outputs(small, ARRAYS)
    _assert_valid_json(chunked, ARRAYS)
    for i, (r, c) in enumerate(zip(reference, chunked)):
        if i % 2 == 0:  # greedy rows: the same tokens whatever the chunking
            assert r.token_ids == c.token_ids, f"{r.text!r} vs {c.text!r} under chunked prefill"
    assert_engine_idle(small)
    assert_engine_idle(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_valid_and_accepts_no_token_twice(llm, tiny_model, mode):
    # 9 usable blocks of 16 tokens for 12 requests that each grow past a block or two.
    tight = LLM(model=tiny_model, num_kv_blocks=10, preemption_mode=mode, swap_space=1 << 26)
    reference = _json_outputs(llm, NESTED)
    squeezed = _json_outputs(tight, NESTED)
    assert tight.stats().num_preemptions > 0, "the pool was meant to force preemption"
    _assert_valid_json(squeezed, NESTED)
    for r, s in zip(reference, squeezed):
        assert r.token_ids == s.token_ids, f"{r.text!r} vs {s.text!r} after {mode} preemption"
    assert_engine_idle(tight)


# ------------------------------------------------------------------ disaggregated hand-over


def test_decode_engine_replays_the_first_token_sampled_by_the_prefill_engine(llm, tiny_model):
    so = StructuredOutput.json_schema(ENUMS)
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_output=so)
    prompt = PROMPTS[2]
    [whole] = llm.generate(prompt, params)

    prefill = llm.engine
    rid = prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, structured_output=so),
                              hold_kv=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.finished), None)
    decode = LLMEngine(model=tiny_model, num_kv_blocks=64)
    assert decode.add_remote_request(prompt, params, request_id=rid) is not None
    outs = [decode.remote_kv_arrived(rid, first.token_ids[0], *prefill.take_held_kv(rid, first.kv_blocks))]
    while decode.has_unfinished_requests():
        outs += decode.step()
    outs = [o for o in outs if o is not None]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == whole.token_ids, f"{decode.tokenizer.decode(tokens)!r} vs {whole.text!r}"
    assert outs[-1].finish_reason == "stop"
    assert decode.stats().num_blocks_in_use == 0 and prefill.stats().num_blocks_in_use == 0


# ------------------------------------------------------------------ vocabulary, validation, abort


def test_ids_past_the_tokenizer_are_masked_when_the_logits_are_wider(tmp_path, default_model):
    vocab = json.loads((default_model / "config.json").read_text())["vocab_size"]
    ckpt = build_hf_checkpoint(tmp_path / "padded", "llama", default_model, seed=5, vocab_size=vocab + 64)
    padded = LLM(model=str(ckpt), num_kv_blocks=64)
    assert padded.engine.model_config.vocab_size == vocab + 64
    so = StructuredOutput.choice(CHOICES)
    outs = padded.generate(PROMPTS[:4], [_params(so, i, max_tokens=30) for i in range(4)])
    assert all(o.text in CHOICES for o in outs), [o.text for o in outs]
    structured = padded.engine.structured
    structured.add("probe", so)
    mask, rows = structured.bitmask(["probe"], [[]])
    logits = torch.zeros(1, vocab + 64)
    apply_token_bitmask(logits, mask, rows)
    assert torch.isinf(logits[0, vocab:]).all(), "ids the tokenizer does not have must never be allowed"
    structured.remove("probe")
    assert_engine_idle(padded)


def test_bitmask_touches_only_the_constrained_rows():
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.zeros(3, 3, dtype=torch.int32)  # everything forbidden
    bitmask[1, 0] = 1 << 4  # row 1: token 4 only
    apply_token_bitmask(logits, bitmask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert logits[1].argmax().item() == 4 and torch.isinf(logits[1]).sum().item() == 69


@pytest.mark.parametrize(
    "so,field",
    [
        (StructuredOutput("json", '{"type": "object", "properties": 3}'), "response_format.json_schema.schema"),
        (StructuredOutput("json", "{not json"), "response_format.json_schema.schema"),
        (StructuredOutput("regex", "(unclosed"), "guided_regex"),
        (StructuredOutput("grammar", "root ::= undefined_rule"), "guided_grammar"),
    ],
)
def test_a_spec_that_does_not_parse_is_refused_naming_the_field(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        check(so)
    # The engine parses on its compile thread, not in add_request: the request ends with an error.
    try:
        rid = llm.engine.add_request("hi", SamplingParams(structured_output=so))
    except ValueError as e:  # what needs no parse (the spec is not JSON) is refused at once
        assert so.spec == "{not json" and field in str(e), e
        return
    [out] = _until_finished(llm.engine, rid)
    assert out.finish_reason == "error" and field in out.stop_reason, (out.finish_reason, out.stop_reason)
    assert_engine_idle(llm)


def _until_finished(engine, *rids: str, limit_s: float = 30.0) -> list:
    """Step ``engine`` until the requests ``rids`` finish; their final outputs, in order."""
    final: dict = {}
    t0 = time.monotonic()
    while len(final) < len(rids):
        assert time.monotonic() - t0 < limit_s, f"requests {set(rids) - set(final)} did not finish in {limit_s}s"
        final.update((o.request_id, o) for o in engine.step() if o.request_id in rids and o.finished)
    return [final[rid] for rid in rids]


def test_add_request_refuses_a_spec_past_its_bounds_before_any_parse(llm):
    bomb = StructuredOutput("json", '{"type": "string", "pattern": "[a-z]{1,20000}"}')  # 36 s to parse
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"response_format\.json_schema\.schema\.pattern .*max_regex_size"):
        llm.engine.add_request("hi", SamplingParams(structured_output=bomb))
    assert time.perf_counter() - t0 < 1.0, "the bound must act before xgrammar parses anything"
    assert_engine_idle(llm)


def test_a_compile_past_its_time_limit_ends_its_request_with_an_error_and_others_run(llm, monkeypatch):
    engine = llm.engine
    cached = StructuredOutput("regex", "[a-c]{2}")
    engine.structured.compiled(cached).result()  # ready at once below
    gate, real_compile = threading.Event(), engine.structured._compile

    def compile_or_hang(so):
        if so.spec == "hang":
            gate.wait(60)
        return real_compile(so)

    monkeypatch.setattr(engine.structured, "_compile", compile_or_hang)
    monkeypatch.setattr(engine.structured, "limits", GrammarLimits(compile_timeout_s=0.2))
    try:
        slow = engine.add_request("hi", SamplingParams(max_tokens=4, structured_output=StructuredOutput("regex", "hang")))
        fine = engine.add_request("hi", SamplingParams(max_tokens=4, structured_output=cached))
        hung, done = _until_finished(engine, slow, fine)
    finally:
        gate.set()
    assert hung.finish_reason == "error" and "compile_timeout_s" in hung.stop_reason, hung
    assert done.finish_reason == "stop" and re.fullmatch("[a-c]{2}", done.text), done
    assert_engine_idle(llm)


def test_a_decode_engine_ends_an_arrival_whose_grammar_failed_and_goes_on(llm, tiny_model):
    so = StructuredOutput("regex", "(unclosed")  # parses on the compile thread, and fails there
    prefill = llm.engine
    rid = prefill.add_request("hi", SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.finished), None)
    decode = LLMEngine(model=tiny_model, num_kv_blocks=64)
    assert decode.add_remote_request("hi", SamplingParams(max_tokens=8, structured_output=so), request_id=rid)
    decode.structured.wait_any(30)
    assert decode.remote_kv_arrived(rid, first.token_ids[0], *prefill.take_held_kv(rid, first.kv_blocks)) is None
    [out] = _until_finished(decode, rid)
    assert out.finish_reason == "error", out
    assert decode.stats().num_blocks_in_use == 0 and not decode.has_unfinished_requests()


def test_bad_constraint_descriptions_are_value_errors():
    for kind, spec in (("yaml", ""), ("choice", "[]"), ("choice", '["a", 3]'), ("choice", "{}")):
        with pytest.raises(ValueError):
            StructuredOutput(kind, spec)


def test_a_request_aborted_while_its_grammar_compiles_ends_cleanly(tiny_model):
    engine = LLMEngine(model=tiny_model, num_kv_blocks=32)
    so = StructuredOutput.json_schema({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(30)}})
    rid = engine.add_request("hi", SamplingParams(max_tokens=5, structured_output=so))
    [out] = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.stats().num_blocks_in_use == 0
