"""Request validation, admission and API keys: the router's pure edge, without Ray."""

from __future__ import annotations

import dataclasses

import pytest

from engine.wire.sampling_params import MAX_BAD_WORDS, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from router.admission import Admission, AdmissionConfig, Intake, IntakeConfig, IntakeTicket, Rejection, Ticket
from router.bodies import parse_json
from router.errors import ApiError
from router.validation import (
    MAX_N,
    MAX_PRIORITY,
    MAX_PROMPTS,
    ServedModel,
    check_api_key,
    choices,
    prepare_chat,
    prepare_completion,
    prepare_completions,
)

MODEL = ServedModel("tandem-tiny-llama", max_model_len=64, vocab_size=1000, block_size=16, max_kv_blocks=3)


class FakeTokenizer:
    """One token per character; a chat template that joins the contents."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "|".join(m["content"] for m in messages) + ">"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def completion(**body):
    return prepare_completion({"model": MODEL.name, "prompt": "hi", **body}, MODEL, FakeTokenizer())


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args, **kwargs)
    return e.value


# -- bodies ----------------------------------------------------------------------


def test_a_valid_completion_becomes_token_ids_and_sampling_params():
    req = completion(max_tokens=5, temperature=0.5, seed=3, stop=["\n"], stream=True,
                     stream_options={"include_usage": True})
    assert req.prompt_token_ids == [104, 105]
    assert (req.params.max_tokens, req.params.temperature, req.params.seed, req.params.stop) == (5, 0.5, 3, ("\n",))
    assert req.stream and req.include_usage


def test_completion_max_tokens_defaults_to_16_and_chat_to_the_rest_of_the_context():
    assert completion().params.max_tokens == 16
    chat = prepare_chat({"messages": [{"role": "user", "content": "hey"}]}, MODEL, FakeTokenizer())
    assert chat.params.max_tokens == MODEL.max_model_len - len("hey>")


def test_chat_content_parts_and_logprobs_map_onto_the_engine():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}],
            "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 4}
    req = prepare_chat(body, MODEL, FakeTokenizer())
    assert req.prompt_token_ids == [97, 98, 62] and req.params.logprobs == 3 and req.params.max_tokens == 4


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"temperature": -0.5}, 400, "temperature"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 63}, 400, "max_tokens"),
        ({"max_tokens": 1.5}, 400, "max_tokens"),
        ({"seed": -1}, 400, "seed"),
        ({"n": 0}, 400, "n"),
        ({"n": 17}, 400, "n"),
        ({"n": True}, 400, "n"),
        ({"n": 2, "best_of": 3}, 400, "best_of"),
        ({"logit_bias": {"1": 101}}, 400, "logit_bias"),
        ({"logit_bias": {"1": -100.5}}, 400, "logit_bias"),
        ({"logit_bias": {"x": 5}}, 400, "logit_bias"),
        ({"logit_bias": {"-1": 5}}, 400, "logit_bias"),
        ({"logit_bias": {" 1": 5}}, 400, "logit_bias"),
        ({"logit_bias": {"1000": 5}}, 400, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 5}}, 400, "logit_bias"),
        ({"logit_bias": {"1": "5"}}, 400, "logit_bias.1"),
        ({"logit_bias": [1, 5]}, 400, "logit_bias"),
        ({"allowed_token_ids": []}, 400, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -1]}, 400, "allowed_token_ids"),
        ({"allowed_token_ids": [1000]}, 400, "allowed_token_ids"),
        ({"allowed_token_ids": [10**30]}, 400, "allowed_token_ids"),
        ({"allowed_token_ids": "1"}, 400, "allowed_token_ids"),
        ({"bad_words": ["ok", ""]}, 400, "bad_words"),
        ({"bad_words": ["  "]}, 400, "bad_words"),
        ({"bad_words": ["\ud800"]}, 400, "bad_words"),
        ({"bad_words": "word"}, 400, "bad_words"),
        ({"bad_words": [3]}, 400, "bad_words.0"),
        ({"prompt": 7}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": [1, 5000]}, 400, "prompt"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": "x" * 64}, 400, "prompt"),
        ({"prompt": "x" * 60, "max_tokens": 1}, 400, "prompt"),  # fits the context, not the KV pool
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_completion_fields_are_rejected_naming_the_field(body, status, param):
    e = error_of(completion, **body)
    assert (e.status, e.param) == (status, param), e.message
    assert param in e.message
    assert e.body()["error"]["param"] == param


def test_token_controls_reach_the_sampling_params_on_both_endpoints():
    body = {"logit_bias": {"7": 2.5, "42": -100}, "allowed_token_ids": [7, 8, 42], "bad_words": ["ab", " cd"]}
    chat = prepare_chat({"messages": [{"role": "user", "content": "x"}], **body}, MODEL, FakeTokenizer())
    for params in (completion(**body).params, chat.params):
        assert params.logit_bias == ((7, 2.5), (42, -100)) and params.allowed_token_ids == (7, 8, 42)
        # One token per character: " ab" is longer than "ab", so only the bare spelling (vLLM's
        # rule; tests/unit/test_tokenization.py has a real tokenizer's spaced variants).
        assert params.bad_words_token_ids == ((97, 98), (99, 100)), params.bad_words_token_ids
    assert completion(logit_bias={}).params.logit_bias == () and completion().params.allowed_token_ids is None


def test_a_list_of_prompts_is_a_request_each_with_the_same_settings():
    batch = prepare_completions({"prompt": ["ab", "c"], "max_tokens": 3, "echo": True}, MODEL, FakeTokenizer())
    assert [p.prompt_token_ids for p in batch] == [[97, 98], [99]] and [p.echo for p in batch] == ["ab", "c"]
    assert all(p.params.max_tokens == 3 for p in batch)
    assert len(prepare_completions({"prompt": [[1, 2], [3]]}, MODEL, FakeTokenizer())) == 2
    e = error_of(prepare_completions, {"prompt": ["ok", "x" * 64]}, MODEL, FakeTokenizer())
    assert (e.status, e.param) == (400, "prompt"), e.message
    e = error_of(prepare_completions, {"prompt": ["a"] * (MAX_PROMPTS + 1)}, MODEL, FakeTokenizer())
    assert (e.status, e.param) == (400, "prompt") and str(MAX_PROMPTS) in e.message, e.message


def test_echo_carries_the_prompt_text_and_with_logprobs_asks_for_the_prompts():
    assert completion(echo=True).echo == "hi" and completion().echo is None
    assert completion(prompt=[104, 105, 33], echo=True).echo == "hi!", "token ids are echoed as decoded"
    both = completion(echo=True, logprobs=3)
    assert both.echo_logprobs and (both.params.logprobs, both.params.prompt_logprobs) == (3, 3)
    assert completion(echo=True, logprobs=1, prompt_logprobs=4).params.prompt_logprobs == 4
    assert not completion(logprobs=2).echo_logprobs and completion(logprobs=2).params.prompt_logprobs is None


def test_prompt_logprobs_reach_the_sampling_params_and_out_of_range_is_a_400():
    assert completion(prompt_logprobs=0).params.prompt_logprobs == 0
    chat = prepare_chat({"messages": [{"role": "user", "content": "hey"}], "prompt_logprobs": 2}, MODEL, FakeTokenizer())
    assert chat.params.prompt_logprobs == 2
    for bad in (-1, 21):
        e = error_of(completion, prompt_logprobs=bad)
        assert (e.status, e.param) == (400, "prompt_logprobs") and str(bad) in e.message, e.message
    e = error_of(completion, prompt_logprobs="2")
    assert e.status == 400 and "prompt_logprobs" in e.message, e.message


def test_bad_chat_messages_are_rejected_naming_the_field():
    tok = FakeTokenizer()
    for messages in ([], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}]):
        e = error_of(prepare_chat, {"messages": messages}, MODEL, tok)
        assert e.status == 400 and e.param.startswith("messages"), (messages, e.message)
    e = error_of(prepare_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, MODEL, tok)
    assert e.param == "top_logprobs"


def test_bodies_must_be_json_objects_under_the_size_limit():
    assert parse_json(b'{"a": 1}', 100) == {"a": 1}
    assert error_of(parse_json, b"{oops", 100).status == 400
    assert error_of(parse_json, b"[1, 2]", 100).status == 400
    e = error_of(parse_json, b" " * 101, 100)
    assert e.status == 413 and "100" in e.message


# -- API key ---------------------------------------------------------------------


def test_a_prompt_with_more_characters_than_the_context_holds_is_refused_before_tokenizing():
    bounded = dataclasses.replace(MODEL, max_chars_per_token=4)  # 63 tokens of 4 characters: 252 at most

    class Untouchable(FakeTokenizer):
        def encode(self, text, add_special_tokens=True):
            raise AssertionError(f"encode was called with {len(text)} characters")

    over = "x" * 253
    cases = [(prepare_completions, {"prompt": over}, "prompt", 253),
             (prepare_completions, {"prompt": [over, "hi"]}, "prompt", 253),
             (prepare_chat, {"messages": [{"role": "user", "content": over[:-1]}]}, "messages", 253)]  # + ">"
    for prepare, body, param, length in cases:
        e = error_of(prepare, body, bounded, Untouchable())
        assert (e.status, e.param, e.code) == (400, param, "context_length_exceeded"), e.message
        assert f"has {length} characters" in e.message and "at most 252 characters" in e.message, e.message
        assert "64 tokens (max_model_len)" in e.message and "4 characters" in e.message, e.message
    e = error_of(prepare_completion, {"prompt": "x" * 252}, bounded, FakeTokenizer())
    assert "has 252 tokens" in e.message, "at the bound the tokenizer decides: " + e.message


def test_api_key_is_checked_only_when_configured():
    check_api_key(None, None)
    check_api_key("s3cret", "s3cret")
    for presented in (None, "", "s3cre", "s3cret!"):
        e = error_of(check_api_key, "s3cret", presented)
        assert e.status == 401 and e.type == "authentication_error"


# -- admission -------------------------------------------------------------------


def test_admission_bounds_outstanding_requests_and_frees_on_release():
    adm = Admission(AdmissionConfig(max_requests=2, max_prompt_tokens=1000))
    a, b = adm.try_admit(10, now=0.0), adm.try_admit(10, now=0.0)
    assert isinstance(a, Ticket) and isinstance(b, Ticket)
    rejected = adm.try_admit(10, now=0.0)
    assert isinstance(rejected, Rejection) and "max_outstanding_requests=2" in rejected.reason
    adm.release(a, now=1.0)
    assert isinstance(adm.try_admit(10, now=1.0), Ticket)
    assert (adm.num_admitted, adm.num_rejected) == (3, 1)


def test_admission_bounds_outstanding_prompt_tokens_but_admits_any_prompt_when_idle():
    adm = Admission(AdmissionConfig(max_requests=10, max_prompt_tokens=100))
    big = adm.try_admit(500, now=0.0)
    assert isinstance(big, Ticket), "an idle router takes a prompt over the token bound"
    rejected = adm.try_admit(1, now=0.0)
    assert isinstance(rejected, Rejection) and "max_outstanding_prompt_tokens=100" in rejected.reason
    adm.release(big, now=0.5)
    assert (adm.requests, adm.prompt_tokens) == (0, 0)


def test_admission_takes_a_batch_whole_or_not_at_all():
    adm = Admission(AdmissionConfig(max_requests=4, max_prompt_tokens=100))
    first = adm.try_admit(10, now=0.0)
    tickets = adm.try_admit_all([20, 30], now=0.0)
    assert [t.prompt_tokens for t in tickets] == [20, 30] and (adm.requests, adm.prompt_tokens) == (3, 60)
    refused = adm.try_admit_all([5, 5], now=0.0)  # the second would be the fifth request
    assert isinstance(refused, Rejection) and refused.code == "max_outstanding_requests", refused
    assert (adm.requests, adm.prompt_tokens, adm.num_admitted) == (3, 60, 3), "the first of the batch was undone"
    with pytest.raises(ValueError, match="5 requests at once are more than"):
        adm.try_admit_all([1] * 5, now=0.0)  # could never fit, even idle
    for t in [first, *tickets]:
        adm.release(t, now=1.0)
    assert len(adm.try_admit_all([1] * 4, now=1.0)) == 4


def test_retry_after_follows_the_recent_finish_rate_within_bounds():
    cfg = AdmissionConfig(max_requests=1, min_retry_after_s=1, max_retry_after_s=30, rate_window_s=10)
    adm = Admission(cfg)
    first = adm.try_admit(1, now=0.0)
    assert adm.try_admit(1, now=0.0).retry_after_s == 1, "no finishes seen yet: the shortest wait"
    adm.release(first, now=1.0)
    held = adm.try_admit(1, now=1.0)
    # One finish in a 10 s window: 0.1 requests/s, so one more slot takes about 10 s.
    assert adm.try_admit(1, now=2.0).retry_after_s == 10
    adm.release(held, now=2.0)
    assert isinstance(adm.try_admit(1, now=100.0), Ticket)
    assert adm.try_admit(1, now=100.0).retry_after_s == 1, "finishes older than the window no longer count"


def test_admission_config_rejects_nonsense():
    for kwargs in ({"max_requests": 0}, {"max_prompt_tokens": 0}, {"min_retry_after_s": 5, "max_retry_after_s": 1}):
        with pytest.raises(ValueError):
            AdmissionConfig(**kwargs)


def test_intake_bounds_the_requests_being_validated_and_frees_on_leave():
    intake = Intake(IntakeConfig(max_requests=2, max_bytes=1000))
    a, b = intake.try_enter(10, now=0.0), intake.try_enter(10, now=0.0)
    assert isinstance(a, IntakeTicket) and isinstance(b, IntakeTicket)
    refused = intake.try_enter(10, now=0.0)
    assert isinstance(refused, Rejection) and refused.code == "max_intake_requests", refused
    assert "validating 2 requests (max_intake_requests=2)" in refused.reason and refused.retry_after_s == 1
    intake.leave(a, now=1.0)
    assert isinstance(intake.try_enter(10, now=1.0), IntakeTicket)
    # One validation ended in the last 10 s (0.1/s): one more place takes about 10 s.
    assert intake.try_enter(10, now=2.0).retry_after_s == 10


def test_intake_bounds_the_bytes_being_validated_but_takes_any_body_when_idle():
    intake = Intake(IntakeConfig(max_requests=10, max_bytes=100))
    big = intake.try_enter(500, now=0.0)
    assert isinstance(big, IntakeTicket), "an idle intake takes a body over the byte bound"
    refused = intake.try_enter(1, now=0.0)
    assert isinstance(refused, Rejection) and refused.code == "max_intake_bytes", refused
    assert "500 bytes of requests and this one adds 1 (max_intake_bytes=100)" in refused.reason
    intake.leave(big, now=0.5)
    assert (intake.requests, intake.bytes) == (0, 0)
    assert [isinstance(intake.try_enter(50, now=0.5), IntakeTicket) for _ in range(3)] == [True, True, False]


def test_intake_config_rejects_nonsense():
    for name in ("threads", "max_requests", "max_bytes"):
        with pytest.raises(ValueError, match=f"intake {name} must be >= 1"):
            IntakeConfig(**{name: 0})


# -- structured output -----------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "extra,kind,field",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         "json", "response_format.json_schema.schema"),
        ({"guided_json": SCHEMA}, "json", "guided_json"),
        ({"guided_json": '{"type": "string"}'}, "json", "guided_json"),
        ({"guided_regex": "[a-z]+"}, "regex", "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
    ],
)
def test_output_constraints_reach_the_sampling_params_on_both_endpoints(extra, kind, field):
    chat = prepare_chat({"messages": [{"role": "user", "content": "x"}], **extra}, MODEL, FakeTokenizer())
    for req in (completion(**extra), chat):
        so = req.params.structured_output
        assert so is not None and so.kind == kind, f"{extra} should constrain the output as {kind}, got {so}"
        assert req.structured_field == field
    if kind == "json" and isinstance(extra.get("guided_json", SCHEMA), dict):
        import json

        assert json.loads(so.spec) == SCHEMA


def test_response_format_text_leaves_the_output_free():
    assert completion(response_format={"type": "text"}).params.structured_output is None
    assert completion().params.structured_output is None


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_or_conflicting_output_constraints_are_rejected_naming_the_field(extra, param):
    e = error_of(completion, **extra)
    assert (e.status, e.param) == (400, param), e.message
    assert param.split(".")[0] in e.message


def test_specs_xgrammar_cannot_parse_are_found_in_a_helper_process_without_torch_here():
    import asyncio
    import sys

    from engine.wire.sampling_params import StructuredOutput
    from router.grammar_check import GrammarChecker

    torch_before = "torch" in sys.modules

    async def main():
        checker = GrammarChecker()
        try:
            bad = await checker.check(StructuredOutput("regex", "(unclosed"), "guided_regex")
            good = await checker.check(StructuredOutput("regex", "[0-9]+"), "guided_regex")
            schema = await checker.check(StructuredOutput("json", '{"type": "frog"}'), "guided_json")
            again = await checker.check(StructuredOutput("regex", "(unclosed"), "guided_regex")
        finally:
            checker.close()
        return bad, good, schema, again

    bad, good, schema, again = asyncio.run(main())
    assert good is None
    assert bad is not None and bad.startswith("guided_regex is not a valid regular expression"), bad
    assert schema is not None and schema.startswith("guided_json is not a valid JSON schema"), schema
    assert again == bad
    assert ("torch" in sys.modules) == torch_before, "the check must not load torch in this process"


def test_grpc_requests_carry_the_same_output_constraints_and_token_controls():
    import json

    from protos.tandem.v1 import generate_pb2 as pb
    from router import grpc_api

    def prepared(**sampling):
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))
        return grpc_api.prepare(request, MODEL, FakeTokenizer())

    assert prepared(guided_regex="[a-z]+").params.structured_output.kind == "regex"
    assert json.loads(prepared(guided_choice=["a", "b"]).params.structured_output.spec) == ["a", "b"]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    req = prepared(response_format=json.dumps(rf))
    assert req.params.structured_output.kind == "json" and req.structured_field == "response_format.json_schema.schema"
    assert prepared().params.structured_output is None
    req = prepared(logit_bias={5: 1.5}, allowed_token_ids=[5, 6], bad_words=["ab"])
    assert (req.params.logit_bias, req.params.allowed_token_ids) == (((5, 1.5),), (5, 6))
    assert req.params.bad_words_token_ids == ((97, 98),)
    for sampling, param in (({"logit_bias": {5: 100.5}}, "logit_bias"),
                            ({"logit_bias": {5000: 1}}, "logit_bias"),
                            ({"allowed_token_ids": [5000]}, "allowed_token_ids"),
                            ({"bad_words": [""]}, "bad_words"),
                            ({"response_format": "{oops"}, "response_format"),
                            ({"guided_json": "[]"}, "guided_json"),
                            ({"guided_regex": "a", "guided_grammar": 'root ::= "a"'}, "guided_grammar")):
        e = error_of(prepared, **sampling)
        assert (e.status, e.param) == (400, param), e.message


def test_grpc_n_and_prompt_logprobs_go_through_the_http_rules():
    import grpc

    from protos.tandem.v1 import generate_pb2 as pb
    from router import grpc_api

    def prepared(**sampling):
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))
        return grpc_api.prepare(request, MODEL, FakeTokenizer())

    assert prepared().n == 1 and prepared().params.prompt_logprobs is None, "unset: one choice, no prompt logprobs"
    req = prepared(n=3, seed=7, prompt_logprobs=2)
    assert req.n == 3 and req.params.prompt_logprobs == 2
    assert [c.prepared.params.seed for c in choices([req])] == [7, 8, 9], "choice i samples with seed + i"
    assert prepared(n=MAX_N).n == MAX_N
    for sampling, param, words in (({"n": 0}, "n", "n must be in [1, 16], got 0"),
                                   ({"n": MAX_N + 1}, "n", "n must be in [1, 16], got 17"),
                                   ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be <= 20")):
        e = error_of(prepared, **sampling)
        assert (e.status, e.param) == (400, param) and words in e.message, e.message
        assert grpc_api.status_code(e) == grpc.StatusCode.INVALID_ARGUMENT


# -- priority --------------------------------------------------------------------------

PRIORITY_MODEL = dataclasses.replace(MODEL, scheduling_policy="priority")


def test_priority_reaches_each_choice_on_both_endpoints_under_the_priority_policy():
    body = {"model": MODEL.name, "n": 2, "priority": -5}
    req = prepare_completion({**body, "prompt": "hi"}, PRIORITY_MODEL, FakeTokenizer())
    assert req.priority == -5 and [c.prepared.priority for c in choices([req])] == [-5, -5]
    chat = prepare_chat({**body, "messages": [{"role": "user", "content": "hey"}]}, PRIORITY_MODEL, FakeTokenizer())
    assert chat.priority == -5
    assert completion().priority == 0 and completion(priority=0).priority == 0, "0 is the default, under fcfs too"
    edge = prepare_completion({"prompt": "hi", "priority": -MAX_PRIORITY}, PRIORITY_MODEL, FakeTokenizer())
    assert edge.priority == -MAX_PRIORITY


@pytest.mark.parametrize("priority, words", [
    (True, "priority: Input should be a valid integer"),
    (1.0, "priority: Input should be a valid integer"),
    ("1", "priority: Input should be a valid integer"),
    (MAX_PRIORITY + 1, f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {MAX_PRIORITY + 1}"),
    (-MAX_PRIORITY - 1, f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]"),
])
def test_a_priority_that_is_not_a_bounded_int_is_a_400_naming_it(priority, words):
    e = error_of(prepare_completion, {"prompt": "hi", "priority": priority}, PRIORITY_MODEL, FakeTokenizer())
    assert (e.status, e.param) == (400, "priority") and words in e.message, e.message


def test_a_nonzero_priority_is_refused_when_the_workers_schedule_fcfs():
    for priority in (1, -1):
        e = error_of(completion, priority=priority)
        assert (e.status, e.param) == (400, "priority") and "'fcfs'" in e.message, e.message
        e = error_of(prepare_chat, {"messages": [{"role": "user", "content": "x"}], "priority": priority},
                     MODEL, FakeTokenizer())
        assert (e.status, e.param) == (400, "priority"), e.message


def test_grpc_priority_goes_through_the_http_rules():
    import grpc

    from protos.tandem.v1 import generate_pb2 as pb
    from router import grpc_api

    def prepared(model, **sampling):
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))
        return grpc_api.prepare(request, model, FakeTokenizer())

    assert prepared(PRIORITY_MODEL).priority == 0, "unset: 0"
    assert prepared(PRIORITY_MODEL, priority=-3).priority == -3
    assert prepared(MODEL, priority=0).priority == 0
    e = error_of(prepared, MODEL, priority=2)
    assert (e.status, e.param) == (400, "priority") and grpc_api.status_code(e) == grpc.StatusCode.INVALID_ARGUMENT


# -- stop conditions ---------------------------------------------------------------------

STOP_LIMITS = [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", f"over the limit of {MAX_STOP_STRINGS}"),
    ({"stop": "y" * (MAX_STOP_STRING_LEN + 1)}, "stop", f"at most {MAX_STOP_STRING_LEN} characters"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", f"over the limit of {MAX_STOP_TOKEN_IDS}"),
]


@pytest.mark.parametrize("fields, param, words", STOP_LIMITS)
def test_stop_conditions_past_their_limits_are_a_400_naming_the_field_and_the_limit(fields, param, words):
    chat = {"messages": [{"role": "user", "content": "x"}], **fields}
    for e in (error_of(completion, **fields), error_of(prepare_chat, chat, MODEL, FakeTokenizer())):
        assert (e.status, e.param) == (400, param) and words in e.message, e.message


def test_stop_conditions_at_their_limits_are_accepted():
    req = completion(stop=["s" * MAX_STOP_STRING_LEN] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    assert (len(req.params.stop), len(req.params.stop_token_ids)) == (MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS)


def test_a_stop_list_past_its_limit_is_refused_before_the_prompt_is_tokenized():
    class CountingTokenizer(FakeTokenizer):
        calls = 0

        def encode(self, text, add_special_tokens=True):
            CountingTokenizer.calls += 1
            return super().encode(text, add_special_tokens)

    body = {"prompt": ["p"] * 8, "stop": ["x"] * 110_000}
    e = error_of(prepare_completions, body, MODEL, CountingTokenizer())
    assert (e.status, e.param, CountingTokenizer.calls) == (400, "stop", 0), e.message


@pytest.mark.parametrize("fields, param, words", STOP_LIMITS)
def test_grpc_stop_conditions_past_their_limits_are_invalid_argument(fields, param, words):
    import grpc

    from protos.tandem.v1 import generate_pb2 as pb
    from router import grpc_api

    stop = fields.get("stop", [])
    sampling = pb.SamplingParams(stop=[stop] if isinstance(stop, str) else stop,
                                 stop_token_ids=fields.get("stop_token_ids", []))
    e = error_of(grpc_api.prepare, pb.GenerateRequest(text="hi", sampling=sampling), MODEL, FakeTokenizer())
    assert (e.param, grpc_api.status_code(e)) == (param, grpc.StatusCode.INVALID_ARGUMENT) and words in e.message


def test_bad_words_past_their_limit_are_refused_before_any_is_tokenized():
    """Each bad word is tokenized twice (as written and after a space): a list of them
    past vLLM's cap is a 400 naming the field and the limit, before any encode."""
    class CountingTokenizer(FakeTokenizer):
        calls = 0

        def encode(self, text, add_special_tokens=True):
            CountingTokenizer.calls += 1
            return super().encode(text, add_special_tokens)

    body = {"prompt": "p", "bad_words": ["w"] * (MAX_BAD_WORDS + 1)}
    e = error_of(prepare_completions, body, MODEL, CountingTokenizer())
    assert (e.status, e.param, CountingTokenizer.calls) == (400, "bad_words", 0), e.message
    assert f"over the limit of {MAX_BAD_WORDS}" in e.message
    accepted = completion(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)])
    assert len(accepted.params.bad_words_token_ids) >= MAX_BAD_WORDS
