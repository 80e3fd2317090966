"""Structured-output specs that would cost minutes are refused in milliseconds, parses
and compiles have a wall-clock limit, and JSON nested too deeply is a 400, never a 500
(issue 53, items 2 and 8). No model, no Ray: the engine's compiles are faked. The
router's helper process imports this module for its fake parse, so torch is imported only
inside the engine's tests.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from engine.grammar import GrammarLimits, precheck, regex_size
from engine.wire.sampling_params import StructuredOutput
from router.bodies import MAX_JSON_DEPTH, parse_json
from router.errors import ApiError
from router.grammar_check import GrammarChecker
from router.validation import ServedModel, prepare_chat, prepare_completion
from tests.helpers import async_wait_for, wait_for

MODEL = ServedModel("m", max_model_len=64, vocab_size=1000, block_size=16, max_kv_blocks=3)
# The issue's bomb: xgrammar 0.2.9 took 36 s to parse it, and the router checked it before admission.
BOMB = '{"type": "string", "pattern": "[a-z]{1,20000}"}'


class FakeTokenizer:
    """One token per character; a chat template that joins the contents (and dumps the tools)."""

    chat_template = ""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        return json.dumps(tools) + "|".join(m["content"] for m in messages)


def _error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value


def _bound_error(so: StructuredOutput, field: str, **limits) -> str:
    with pytest.raises(ValueError) as e:
        precheck(so, field, GrammarLimits(**limits))
    return str(e.value)


# -- bounds, before any parse -------------------------------------------------------------


@pytest.mark.parametrize("regex,size", [
    ("[a-z]{1,20000}", 20000), ("a{3}", 3), ("(ab){1,5}", 10), ("(a{1,10}){1,10}", 100), (r"\d{3}-\d{4}", 8),
    ("[{]{4}", 4), ("[^]]{4}", 5), ("a*b+c?", 3), ("a{2,}", 2), (r"a\{5}", 4), ("x{99999999999999999999999}", 1 << 62),
])
def test_a_regex_is_measured_with_its_repetitions_written_out(regex, size):
    assert regex_size(regex) == size, f"{regex!r} should count {size}"


def test_the_issues_bomb_is_refused_before_any_parse_naming_the_path_and_the_limit():
    async def main():
        checker = GrammarChecker()
        try:
            t0 = time.perf_counter()
            why = await checker.check(StructuredOutput("json", BOMB), "guided_json")
            return why, time.perf_counter() - t0
        finally:
            checker.close()

    why, took = asyncio.run(main())
    assert why is not None and "guided_json.pattern" in why and "max_regex_size" in why, why
    assert took < 1.0, f"refused after {took:.2f}s: the bound must act before xgrammar parses anything"


@pytest.mark.parametrize("schema,path,limit", [
    ({"properties": {"a": {"type": "string", "maxLength": 10**9}}}, "f.properties.a.maxLength", "max_schema_bound"),
    ({"type": "array", "minItems": 200_000}, "f.minItems", "max_schema_bound"),
    ({"patternProperties": {"^[a-z]{1,5000}$": {}}}, "f.patternProperties.^[a-z]{1,5000}$", "max_regex_size"),
    ({"properties": {f"p{i}": {"pattern": "[a-z]{1,600}"} for i in range(20)}}, "f's regular expressions",
     "max_total_regex_size"),
    (json.loads('{"items":' * 70 + "{}" + "}" * 70), "f.items.items", "max_schema_depth"),
])
def test_each_bound_of_a_json_schema_names_the_path_and_the_limit(schema, path, limit):
    why = _bound_error(StructuredOutput.json_schema(schema), "f")
    assert why.startswith(path) and limit in why, why


def test_data_and_property_names_are_not_taken_for_keywords_and_regexes_have_bounds_too():
    data = {"enum": [{"maxLength": 10**9, "pattern": "a{99999}"}], "properties": {"pattern": {"type": "string"}}}
    precheck(StructuredOutput.json_schema(data), "f", GrammarLimits())
    assert "max_regex_size" in _bound_error(StructuredOutput("regex", "(ab){1,2000}"), "guided_regex")
    precheck(StructuredOutput("regex", "[a-z]{1,1000}"), "guided_regex", GrammarLimits())


def test_limits_are_validated():
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarLimits(compile_timeout_s=0)


# -- the router's helper: a wall-clock limit on each parse --------------------------------


def _judge(kind: str, spec: str) -> str | None:
    """The helper's parse, faked (in the helper process): a regex ``slow:<path>`` touches
    ``<path>`` and then never ends; anything else parses at once."""
    if kind == "regex" and spec.startswith("slow:"):
        Path(spec[5:]).touch()
        time.sleep(3600)
    return None


def test_a_parse_past_the_time_limit_is_a_400_naming_the_limit_and_the_next_check_gets_a_new_helper(tmp_path):
    slow = StructuredOutput("regex", f"slow:{tmp_path / 'started'}")

    async def main():
        checker = GrammarChecker(GrammarLimits(compile_timeout_s=0.5), judge=_judge)
        try:
            why = await checker.check(slow, "guided_regex")
            t0 = time.perf_counter()
            again = await checker.check(slow, "guided_regex")
            cached_s = time.perf_counter() - t0
            fine = await checker.check(StructuredOutput("regex", "[0-9]+"), "guided_regex")
            return why, again, cached_s, fine
        finally:
            checker.close()

    why, again, cached_s, fine = asyncio.run(main())
    assert why is not None and why.startswith("guided_regex") and "compile_timeout_s" in why, why
    assert again == why and cached_s < 0.1, "the verdict on a spec past the limit is cached"
    assert fine is None, "a new helper must answer the next check"


def test_a_check_cancelled_while_its_spec_is_parsed_kills_the_helper(tmp_path):
    started = tmp_path / "started"

    async def main():
        checker = GrammarChecker(GrammarLimits(compile_timeout_s=600), judge=_judge)
        try:
            assert await checker.check(StructuredOutput("regex", "a"), "guided_regex") is None  # the helper is up
            process = checker._helper.process
            task = asyncio.create_task(checker.check(StructuredOutput("regex", f"slow:{started}"), "guided_regex"))
            await async_wait_for(started.exists, 30, "the helper to begin the slow parse")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return process
        finally:
            checker.close()

    process = asyncio.run(main())
    assert not process.is_alive(), "the client went away: its parse must end with the helper"


# -- the engine's compiles: a wall-clock limit, and no queue behind a bomb --------------


class _FakeCompiles:
    """Stands in for xgrammar in a ``StructuredOutputs``: the regex "slow" blocks until
    ``release``; any other spec compiles at once. Records the specs begun."""

    def __init__(self, structured) -> None:
        self.begun: list[str] = []
        self.gate = threading.Event()
        structured._ensure_compiler = lambda: None
        structured._compile = self.compile

    def compile(self, so: StructuredOutput) -> str:
        self.begun.append(so.spec)
        if so.spec == "slow":
            self.gate.wait(60)
        return f"grammar of {so.spec}"


@pytest.fixture
def structured():
    from engine.structured_output import StructuredOutputs

    s = StructuredOutputs(None, 8, (), GrammarLimits(compile_timeout_s=10.0), clock=lambda: 100.0)
    fakes = _FakeCompiles(s)
    yield s, fakes
    fakes.gate.set()  # the given-up compile's thread may leave


def test_a_compile_past_its_limit_fails_its_requests_and_the_queue_behind_it_moves_on(structured):
    s, fakes = structured
    s.add("bomb", StructuredOutput("regex", "slow"))
    s.add("next", StructuredOutput("regex", "fine"))
    wait_for(lambda: s.overdue(1e9), 10, "the slow compile to begin")
    s.expire(109.0)
    assert not s.is_ready("bomb") and not s.is_ready("next"), "within its limit, and the next waits its turn"
    s.expire(111.0)
    assert s.is_ready("bomb") and "compile_timeout_s" in str(s.error("bomb")), s.error("bomb")
    wait_for(lambda: s.is_ready("next"), 10, "the compile queued behind the bomb, on a fresh thread")
    assert s.error("next") is None and fakes.begun == ["slow", "fine"]
    s.add("again", StructuredOutput("regex", "slow"))
    assert s.is_ready("again") and s.error("again") is not None, "the failure is cached: no second compile"


def test_a_compile_whose_requests_are_all_aborted_before_it_begins_never_runs(structured):
    s, fakes = structured
    s.add("bomb", StructuredOutput("regex", "slow"))
    s.add("gone", StructuredOutput("regex", "never"))
    s.add("kept", StructuredOutput("regex", "kept"))
    wait_for(lambda: s.overdue(1e9), 10, "the slow compile to begin")
    s.remove("gone")
    fakes.gate.set()
    wait_for(lambda: s.is_ready("kept"), 10, "the compile queued last")
    assert fakes.begun == ["slow", "kept"], "an aborted request's compile must not start"
    s.add("back", StructuredOutput("regex", "never"))  # asked again: compiled afresh, not a cancelled future
    wait_for(lambda: s.is_ready("back"), 10, "the spec asked for again")
    assert s.error("back") is None


# -- JSON nested too deeply: a 400 naming the field, never a RecursionError ---------------


def test_a_deeply_nested_guided_json_string_is_a_400_naming_the_field():
    deep = "[" * 100_000 + "]" * 100_000
    e = _error(prepare_completion, {"prompt": "hi", "guided_json": deep}, MODEL, FakeTokenizer())
    assert (e.status, e.param) == (400, "guided_json") and "nested too deeply" in e.message, e.message


@pytest.mark.parametrize("where", ["response_format", "guided_json", "tools"])
def test_a_body_nested_past_the_limit_is_a_400(where):
    deep = "[" * 900 + "]" * 900
    body = {
        "response_format": '{"response_format": {"type": "json_schema", "json_schema": {"schema": {"a": %s}}}',
        "guided_json": '{"guided_json": {"a": %s}',
        "tools": '{"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": %s}}}], '
                 '"tool_choice": "required"',
    }[where] % deep
    raw = ('{"messages": [{"role": "user", "content": "hi"}], ' + body[1:] + "}").encode()

    def prepare():
        return prepare_chat(parse_json(raw, 1 << 20), MODEL, FakeTokenizer())

    e = _error(prepare)
    assert e.status == 400 and f"more than {MAX_JSON_DEPTH} levels" in e.message, e.message


def test_grpc_response_format_nested_too_deeply_is_invalid_argument():
    from protos.tandem.v1 import generate_pb2 as pb
    from router import grpc_api

    for depth in (900, 100_000):
        rf = '{"type": "json_schema", "json_schema": {"schema": {"a": ' + "[" * depth + "]" * depth + "}}}"
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(response_format=rf))
        e = _error(grpc_api.prepare, request, MODEL, FakeTokenizer())
        assert (e.status, e.param) == (400, "response_format"), e.message
