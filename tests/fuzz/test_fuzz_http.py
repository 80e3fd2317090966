"""Fuzzing the HTTP API of a live service with hypothesis.

One service for both fuzz modules (1 prefill + 1 decode worker, tiny model, a 64 KiB
body limit). Every route the app serves gets generated requests: random JSON of every
type in every field of both POST bodies, missing and extra fields, huge, negative and
non-finite numbers, deep nesting, odd unicode (lone surrogates, RTL marks, emoji, NUL),
long strings, token-id prompts with out-of-vocabulary ids, raw garbage bodies, wrong
content types, other methods and paths, and garbage on the raw socket.

The oracle is the router's own validation, run locally on the same bytes
(``parse_json`` + ``prepare_completion`` / ``prepare_chat`` with the served model's
limits and tokenizer): a body it rejects must get that status and ``param`` in the
OpenAI error JSON; a body it accepts must get 200 and a well-formed response (whole or
SSE). The oracle runs the router's check of a structured-output spec too (its bounds,
then xgrammar's parse: ``tests.fuzz.conftest.check_grammar``), which the service runs
after validation. Accepted bodies are made cheap first: their ``max_tokens`` is set to
``CAP``. Nothing may ever answer 5xx. The module ends with a normal request and, like
every test here, with no KV blocks in use. Cases tried per test are printed (``-s``)
and written to ``fuzz-http.json`` in the session's temp folder.

Hostile bodies (issue 53: grammar bombs, JSON text nested 20000 deep, stop lists and
prompts far over their limits; ``HOSTILE_COMPLETION``, ``HOSTILE_CHAT``) are drawn among
the random ones, as whole bodies and as single fields' values, and each is also sent once
by itself (``test_each_hostile_body_gets_its_answer_at_once``): its status, ``param``,
the limit its message names, within ``ANSWER_S``. Those of a megabyte (110k stop
strings, 1 MB prompts) need the default 1 MiB body limit: they are sent beside a running
stream in ``tests/integration/test_hostile_bodies.py``.
"""

from __future__ import annotations

import errno
import json
import math
import socket
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:  # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

from router.bodies import parse_json
from router.errors import ApiError
from router.tokenization import detokenize, tokenize
from router.validation import prepare_chat, prepare_completions
from tests.fuzz.conftest import MAX_BODY, check_grammar
from tests.helpers import tally, write_report

CAP = 4  # max_tokens of a body the server will accept
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
CASES: Counter = Counter()  # (test, outcome) -> requests sent
ANSWERED_S: dict[str, float] = {}  # hostile body sent by itself -> seconds to its answer
SERVED = "<the served model's name>"  # strategies draw this; the tests put in the real name

pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module", autouse=True)
def report(tmp_path_factory):
    yield
    by_test, total = tally(CASES), sum(CASES.values())
    server_errors = sum(n for (_, outcome), n in CASES.items() if outcome.startswith("5"))
    path = write_report(tmp_path_factory, "fuzz-http.json", {"total": total, "5xx": server_errors, "by_test": by_test})
    print(f"\nHTTP fuzz: {total} requests, {server_errors} answered 5xx; by test and status: {by_test} ({path})")
    if ANSWERED_S:
        slowest = max(ANSWERED_S, key=ANSWERED_S.__getitem__)
        print(f"hostile bodies: {len(ANSWERED_S)} answered, the slowest in {ANSWERED_S[slowest]:.3f}s ({slowest})")


# -- strategies ----------------------------------------------------------------

ODD_STRINGS = [
    "", " ", "\x00", "a\x00b", "\ud800", "x\udfffy", "\ud83d", "\u202eevil\u202c", "שלום עולם", "مرحبا",
    "\U0001f600\U0001f469\u200d\U0001f4bb", "\ufeff", "\uffff", "\r\n\t\x0b", "<s>", "</s>", "<|im_end|>",
    "{{ raise_exception('boom') }}", "{% for x in range(99999999) %}x{% endfor %}", "%s%n%x", "' OR 1=1 --",
    "../../etc/passwd", "a" * 3000, "word " * 700,
]
any_text = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=()), max_size=40),  # surrogates included
    st.sampled_from(ODD_STRINGS),
    st.text(max_size=200),
)
big_ints = st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, -(10**30), 10**300])
any_int = st.one_of(st.integers(), big_ints)
any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0]),
)
scalars = st.one_of(st.none(), st.booleans(), any_int, any_float, any_text)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=10
)


def either(plausible):
    """Mostly a plausible value for the field, sometimes any JSON at all."""
    return st.one_of(plausible, plausible, json_values)


token_ids = st.lists(
    st.one_of(st.integers(0, 4095), st.integers(-5, 5), st.integers(4090, 5000), big_ints), min_size=0, max_size=24
)


# -- hostile bodies (issue 53) ---------------------------------------------------
# Each once cost a service seconds to minutes of a grammar parse that nothing stops, or
# its event loop: a patch on a small valid body, with the answer it must get. All fit the
# 64 KiB limit.


@dataclass(frozen=True)
class Hostile:
    """A patch on a small valid body and the answer it must get: ``status``, ``param``,
    and ``says``, a part of the message (the limit it names)."""

    patch: dict
    status: int = 400
    param: str | None = None
    says: str = ""


def _deep_list(depth: int) -> list:
    """A list nested ``depth`` levels deep."""
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


def _deep_items(depth: int) -> dict:
    """A schema of arrays of arrays, ``depth`` levels of ``items``."""
    out: dict = {}
    for _ in range(depth):
        out = {"items": out}
    return out


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


BOMB = {"type": "string", "pattern": "[a-z]{1,20000}"}  # 36 s of xgrammar's parse, unbounded
NESTED_REPEATS = {"type": "string", "pattern": "(a{1,100}){1,100}"}
LONG_TEXT = "x" * 40_000  # far past the tiny model's prompt bound, (512 - 1) tokens of at most 16 characters
HOSTILE_COMPLETION = {
    "schema bomb": Hostile({"guided_json": BOMB}, param="guided_json", says="(max_regex_size)"),
    "schema as JSON text nested 20000 deep": Hostile({"guided_json": "[" * 20_000 + "]" * 20_000},
                                                     param="guided_json", says="nested too deeply"),
    "schema nested 600 deep": Hostile({"guided_json": {"a": _deep_list(600)}}, says="more than 128 levels"),
    "nested repeats in a pattern": Hostile({"guided_json": NESTED_REPEATS}, param="guided_json",
                                           says="(max_regex_size)"),
    "maxLength of a billion": Hostile({"guided_json": {"type": "string", "maxLength": 10**9}},
                                      param="guided_json", says="(max_schema_bound)"),
    "items nested 70 deep": Hostile({"guided_json": _deep_items(70)}, param="guided_json",
                                    says="(max_schema_depth)"),
    "20 patterns of 600": Hostile(
        {"guided_json": {"type": "object",
                         "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,600}"} for i in range(20)}}},
        param="guided_json", says="(max_total_regex_size)"),
    "guided_regex repeating 5000 times": Hostile({"guided_regex": "[a-z]{1,5000}"}, param="guided_regex",
                                                 says="(max_regex_size)"),
    "16 stop strings": Hostile({"stop": ["x"] * 16}, status=200),
    "17 stop strings": Hostile({"stop": ["x"] * 17}, param="stop", says="stop has 17 strings, over the limit of 16"),
    "10000 stop strings, n 16": Hostile({"stop": ["x"] * 10_000, "n": 16}, param="stop",
                                        says="stop has 10000 strings, over the limit of 16"),
    "a stop string of 128": Hostile({"stop": "y" * 128}, status=200),
    "a stop string of 129": Hostile({"stop": "y" * 129}, param="stop", says="(stop[0])"),
    "a second stop string of 129": Hostile({"stop": ["ok", "y" * 129]}, param="stop", says="(stop[1])"),
    "128 stop_token_ids": Hostile({"stop_token_ids": [1] * 128}, status=200),
    "129 stop_token_ids": Hostile({"stop_token_ids": [1] * 129}, param="stop_token_ids", says="over the limit of 128"),
    "10000 stop_token_ids": Hostile({"stop_token_ids": [1] * 10_000}, param="stop_token_ids",
                                    says="over the limit of 128"),
    "a prompt of 40000 characters": Hostile({"prompt": LONG_TEXT}, param="prompt", says="prompt has 40000 characters"),
    "a second prompt of 40000 characters": Hostile({"prompt": ["hi", LONG_TEXT]}, param="prompt",
                                                   says="prompt has 40000 characters"),
}
HOSTILE_CHAT = {
    "schema bomb": Hostile({"guided_json": BOMB}, param="guided_json", says="(max_regex_size)"),
    "response_format with nested repeats": Hostile({"response_format": _json_schema(NESTED_REPEATS)},
                                                   param="response_format.json_schema.schema",
                                                   says="(max_regex_size)"),
    "response_format nested 600 deep": Hostile({"response_format": _json_schema({"a": _deep_list(600)})},
                                               says="more than 128 levels"),
    "tool parameters nested 600 deep": Hostile({"tools": [_tool({"a": _deep_list(600)})]}, says="more than 128 levels"),
    "schema bomb in a required tool": Hostile({"tools": [_tool({"type": "object", "properties": {"a": BOMB}})],
                                               "tool_choice": "required"}, param="tools", says="(max_regex_size)"),
    "schema bomb in a named tool": Hostile({"tools": [_tool({"type": "object", "properties": {"a": BOMB}})],
                                            "tool_choice": {"type": "function", "function": {"name": "f"}}},
                                           param="tools.0.function.parameters", says="(max_regex_size)"),
    "call arguments nested 900 deep": Hostile(
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"a":' * 900 + "1" + "}" * 900}}]},
            {"role": "user", "content": "hi"}]},
        param="messages.0.tool_calls.0.function.arguments", says="more than 128 levels"),
    "17 stop strings": Hostile({"stop": ["x"] * 17}, param="stop", says="stop has 17 strings, over the limit of 16"),
    "content of 40000 characters": Hostile({"messages": [{"role": "user", "content": LONG_TEXT}]}, param="messages",
                                           says="characters"),
}


def hostile_values(name: str) -> list:
    """The values the hostile bodies give field ``name``: drawn among its random ones."""
    return [h.patch[name] for h in (*HOSTILE_COMPLETION.values(), *HOSTILE_CHAT.values()) if name in h.patch]


SAMPLING = {
    "model": st.sampled_from([SERVED, "no-such-model", ""]),
    "max_tokens": st.one_of(st.integers(-2, 600), big_ints),
    "temperature": st.one_of(st.floats(-1, 3), any_float),
    "top_p": st.one_of(st.floats(-0.5, 1.5), any_float),
    "top_k": st.one_of(st.integers(-2, 5000), big_ints),
    "min_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.floats(-1, 3),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "seed": any_int,
    "stop": st.one_of(any_text, st.lists(any_text, max_size=3), st.sampled_from(hostile_values("stop"))),
    "stop_token_ids": st.one_of(token_ids, st.sampled_from(hostile_values("stop_token_ids"))),
    "ignore_eos": st.booleans(),
    "min_tokens": st.one_of(st.integers(-1, 10), big_ints),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "n": st.integers(0, 3),
    "best_of": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.one_of(any_text, any_int.map(str)), st.one_of(any_float, st.floats(-120, 120)),
                                  max_size=3),
    "allowed_token_ids": token_ids,
    "bad_words": st.one_of(any_text, st.lists(any_text, max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": any_text,
    "guided_json": st.one_of(json_values, any_text, st.sampled_from(hostile_values("guided_json"))),
    "guided_regex": st.one_of(any_text, st.sampled_from(hostile_values("guided_regex"))),
}
COMPLETION = {
    **SAMPLING,
    "prompt": st.one_of(any_text, token_ids, st.lists(any_text, max_size=2), st.lists(token_ids, max_size=2),
                        st.sampled_from(hostile_values("prompt"))),
    "logprobs": st.integers(-2, 25),
    "echo": st.booleans(),
    "suffix": any_text,
}
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": any_text})
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "root", ""]),
        "content": st.one_of(st.none(), any_text, st.lists(part, max_size=3)),
        "name": any_text,
    },
)
CHAT = {
    **SAMPLING,
    "messages": st.one_of(st.lists(message, max_size=4), st.sampled_from(hostile_values("messages"))),
    "max_completion_tokens": st.one_of(st.integers(-2, 600), big_ints),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-2, 25),
    "tools": st.one_of(st.lists(json_values, max_size=2), st.sampled_from(hostile_values("tools"))),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "response_format": st.one_of(st.just({"type": "text"}), st.dictionaries(any_text, json_values, max_size=2),
                                 st.sampled_from(hostile_values("response_format"))),
}


VALID_SAMPLING = {
    "model": st.just(SERVED),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.integers(0, 100), big_ints.filter(lambda n: n > 0)),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**70),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 4095), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "n": st.just(1),
    "logit_bias": st.dictionaries(st.integers(0, 4095).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 4095), min_size=1, max_size=5),
    "bad_words": st.lists(st.text(min_size=1, max_size=6).filter(str.strip), max_size=3),
    "stream": st.booleans(),
    "user": st.text(max_size=10),
}
VALID_COMPLETION = {
    **VALID_SAMPLING,
    "prompt": st.one_of(
        st.text(min_size=1, max_size=80), st.lists(st.integers(0, 4095), min_size=1, max_size=30),
        st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),  # a choice each
    ),
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
}
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
VALID_CHAT = {
    **VALID_SAMPLING,
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                               "content": st.one_of(st.text(max_size=40), st.lists(text_part, max_size=2))}),
        min_size=1, max_size=3,
    ),
    "max_completion_tokens": st.integers(1, 8),
    "logprobs": st.booleans(),
    "response_format": st.just({"type": "text"}),
}


@st.composite
def bodies(draw, fields: dict, valid: dict, required: str, hostile: dict | None = None):
    """A dict body: all valid fields, all valid but one, or chaos, or (given ``hostile``)
    a valid body with a hostile patch; sometimes extra keys."""
    mode = draw(st.sampled_from(["valid", "one off", "one off", "chaos"] + (["hostile"] if hostile else [])))
    if mode == "chaos":
        others = {k: either(v) for k, v in fields.items() if k != required}
        body = draw(st.fixed_dictionaries({}, optional={required: either(fields[required]), **others}))
    else:
        others = {k: v for k, v in valid.items() if k != required}
        body = draw(st.fixed_dictionaries({required: valid[required]}, optional=others))
        if mode == "one off":
            name = draw(st.sampled_from(sorted(fields)))
            how = draw(st.sampled_from(["plausible", "plausible", "any JSON", "missing"]))
            if how == "missing":
                body.pop(name, None)
            else:
                body[name] = draw(fields[name] if how == "plausible" else json_values)
        elif mode == "hostile":
            body.update(draw(st.sampled_from(list(hostile.values()))).patch)
    extra = draw(st.one_of(st.just({}), st.dictionaries(any_text, json_values, max_size=2)))
    return {**extra, **body}


content_types = st.sampled_from([
    "application/json", "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/octet-stream", "", "garbage/\tx;;=", None,
])


# -- the oracle ----------------------------------------------------------------


def predict(raw: bytes, chat: bool, oracle) -> ApiError | None:
    """What the router says of these bytes before admission (its validation, then its check
    of an output constraint): the ApiError, or None (accepted)."""
    model, tokenizer = oracle
    try:
        body = parse_json(raw, MAX_BODY)
        batch = [prepare_chat(body, model, tokenizer)] if chat else prepare_completions(body, model, tokenizer)
        for prepared in batch:
            check_grammar(prepared)
    except ApiError as e:
        return e
    return None


def cheap(body: dict, chat: bool, oracle) -> dict:
    """The body with the served model's name in, and max_tokens CAP if the server would
    accept it."""
    if isinstance(body, dict) and body.get("model") == SERVED:
        body = {**body, "model": oracle[0].name}
    if isinstance(body, dict) and predict(_dumps(body), chat, oracle) is None:
        body = dict(body)
        if chat and "max_completion_tokens" in body:
            body["max_completion_tokens"] = CAP
        else:
            body["max_tokens"] = CAP
    return body


def _dumps(body) -> bytes:
    return json.dumps(body).encode()  # ASCII: NaN, Infinity and \\ud800 escapes as a client may send them


def nesting(raw: bytes) -> int:
    """How deep the brackets in ``raw`` nest, outside strings (for JSON-ish bytes)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            escaped, in_string = (not escaped and byte == 0x5C), in_string and (escaped or byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def check_response(r, expected: ApiError | None, stream: bool, test: str, raw: bytes = b"") -> None:
    CASES[(test, str(r.status_code))] += 1
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code == 400 and "nested too deeply" in r.text and nesting(raw) > 200:
        return  # where json's recursion limit bites depends on the stack under the parser
    if expected is not None:
        assert r.status_code == expected.status, (r.status_code, r.text[:300], expected.message)
        error = r.json()["error"]
        assert error["message"] and error["type"], error
        assert error["param"] == expected.param, (error, expected.param)
        return
    assert r.status_code == 200, r.text[:500]
    if not stream:
        out = r.json()
        assert out["choices"] and out["usage"]["completion_tokens"] <= CAP * len(out["choices"]), out
        assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"]))), out
        return
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and not any("error" in c for c in chunks), chunks[-3:]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finishes[-1] in ("length", "stop"), finishes


def post(http, path: str, raw: bytes, content_type: str | None):
    headers = {} if content_type is None else {"content-type": content_type}
    return http.post(path, content=raw, headers=headers)


def check_body(http, oracle, body, content_type, chat: bool) -> None:
    """Send a generated body (made cheap) and judge the answer by the local oracle."""
    body = cheap(body, chat=chat, oracle=oracle)
    raw = _dumps(body)
    r = post(http, "/v1/chat/completions" if chat else "/v1/completions", raw, content_type)
    check_response(r, predict(raw, chat, oracle), body.get("stream") is True, "chat" if chat else "completions")


# -- the tests -----------------------------------------------------------------


@settings(FUZZ, max_examples=500)
@given(body=bodies(COMPLETION, VALID_COMPLETION, "prompt", HOSTILE_COMPLETION), content_type=content_types)
def test_completions_bodies(http, oracle, body, content_type):
    check_body(http, oracle, body, content_type, chat=False)


@settings(FUZZ, max_examples=500)
@given(body=bodies(CHAT, VALID_CHAT, "messages", HOSTILE_CHAT), content_type=content_types)
def test_chat_completions_bodies(http, oracle, body, content_type):
    check_body(http, oracle, body, content_type, chat=True)


# Found by this fuzzer: where an output constraint and the token controls (allowed_token_ids,
# bad_words) leave no token allowed, the engine draws one at logprob -inf, which JSON cannot
# carry: with logprobs the whole response was a 500 (and a stream sent -Infinity). The
# router floors logprobs at -9999.0, as vLLM does.
NO_TOKEN_LEFT = {"prompt": "0", "max_tokens": 1, "logprobs": 0, "allowed_token_ids": [0], "guided_regex": ""}


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_leaves_no_token_allowed_is_no_server_error(http, stream):
    r = http.post("/v1/completions", json={**NO_TOKEN_LEFT, "stream": stream})
    assert r.status_code == 200 and "Infinity" not in r.text and "NaN" not in r.text, r.text


ANSWER_S = 2.0  # a refusal here takes milliseconds; unbounded, the grammar cases took 10 s to minutes
SMALL_COMPLETION = {"prompt": "hi", "max_tokens": 1}
SMALL_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def send_timed(http, oracle, body: dict, chat: bool, test: str) -> tuple[dict | None, ApiError | None]:
    """Send ``body`` with the served model's name, judge the answer by the oracle, and
    record its time; (the error JSON or None, the oracle's verdict)."""
    raw = _dumps({**body, "model": oracle[0].name})
    expected = predict(raw, chat, oracle)
    start = time.monotonic()
    r = post(http, "/v1/chat/completions" if chat else "/v1/completions", raw, "application/json")
    ANSWERED_S[test] = time.monotonic() - start
    check_response(r, expected, False, "hostile", raw)
    return (r.json()["error"] if r.status_code != 200 else None), expected


@pytest.mark.parametrize(("chat", "name"), [pytest.param(False, n, id=f"completions: {n}") for n in HOSTILE_COMPLETION]
                         + [pytest.param(True, n, id=f"chat: {n}") for n in HOSTILE_CHAT])
def test_each_hostile_body_gets_its_answer_at_once(http, oracle, chat, name):
    """Each hostile body by itself: its status, param and named limit, within ANSWER_S."""
    case = (HOSTILE_CHAT if chat else HOSTILE_COMPLETION)[name]
    test = f"{'chat' if chat else 'completions'}: {name}"
    error, expected = send_timed(http, oracle, {**(SMALL_CHAT if chat else SMALL_COMPLETION), **case.patch}, chat, test)
    predicted = (200, None) if expected is None else (expected.status, expected.param)
    assert predicted == (case.status, case.param), f"the oracle says {predicted}: {expected and expected.message}"
    if error is not None:
        assert case.says in error["message"], (case.says, error["message"])
        assert ANSWERED_S[test] < ANSWER_S, f"answered in {ANSWERED_S[test]:.2f}s, over {ANSWER_S}s"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_prompt_past_the_character_bound_is_refused_before_tokenizing(http, oracle, chat):
    """Text over (max_model_len - 1) * max_chars_per_token characters (the completion's one
    past it; the chat's at it, before the template adds its own): a 400 counting characters."""
    most = oracle[0].max_prompt_chars
    assert most is not None, "the tiny model's tokenizer bounds the characters of a token"
    body = {"messages": [{"role": "user", "content": "x" * most}]} if chat else {"prompt": "x" * (most + 1)}
    test = f"{'chat' if chat else 'completions'}: a prompt past {most} characters"
    error, expected = send_timed(http, oracle, body, chat, test)
    assert expected is not None and error is not None, "refused"
    assert error["param"] == ("messages" if chat else "prompt") and error["code"] == "context_length_exceeded", error
    assert f"at most {most} characters" in error["message"], error["message"]
    assert ANSWERED_S[test] < ANSWER_S, f"answered in {ANSWERED_S[test]:.2f}s, over {ANSWER_S}s"


TOKENIZE = {
    "model": st.sampled_from([SERVED, "no-such-model"]),
    "prompt": st.one_of(any_text, token_ids),
    "add_special_tokens": st.booleans(),
    "return_token_strs": st.booleans(),
}
TOKENIZE_CHAT = {
    **TOKENIZE,
    "messages": st.lists(message, max_size=3),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
}
DETOKENIZE = {"model": TOKENIZE["model"], "tokens": token_ids}
VALID_TOKENIZE = {"model": st.just(SERVED), "prompt": st.text(max_size=80), "add_special_tokens": st.booleans()}
VALID_TOKENIZE_CHAT = {**VALID_TOKENIZE, "messages": VALID_CHAT["messages"], "add_generation_prompt": st.booleans()}
VALID_DETOKENIZE = {"model": st.just(SERVED), "tokens": st.lists(st.integers(0, 4095), max_size=30)}
tokenizer_calls = st.one_of(
    st.tuples(st.just("/tokenize"), bodies(TOKENIZE, VALID_TOKENIZE, "prompt")),
    st.tuples(st.just("/tokenize"), bodies(TOKENIZE_CHAT, VALID_TOKENIZE_CHAT, "messages")),
    st.tuples(st.just("/detokenize"), bodies(DETOKENIZE, VALID_DETOKENIZE, "tokens")),
)


@settings(FUZZ, max_examples=300)
@given(call=tokenizer_calls, content_type=content_types)
def test_tokenizer_bodies(http, oracle, call, content_type):
    """A tokenizer call gets exactly what the router's own code answers locally."""
    path, body = call
    if body.get("model") == SERVED:
        body = {**body, "model": oracle[0].name}
    raw = _dumps(body)
    handle = tokenize if path == "/tokenize" else detokenize
    try:
        expected, error = handle(parse_json(raw, MAX_BODY), *oracle), None
    except ApiError as e:
        expected, error = None, e
    r = post(http, path, raw, content_type)
    CASES[(path, str(r.status_code))] += 1
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if error is not None:
        assert (r.status_code, r.json()["error"]["param"]) == (error.status, error.param), (r.text[:300], error.message)
    else:
        assert r.status_code == 200 and r.json() == expected, (r.text[:300], expected)


def _nested(depth: int, opener: str) -> bytes:
    if opener == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.text(alphabet=st.characters(exclude_categories=()), max_size=100).map(
        lambda s: s.encode("utf-8", "surrogatepass")),
    json_values.map(_dumps),  # any JSON, mostly not an object
    st.tuples(st.integers(1, 40_000), st.sampled_from(["[", "{"])).map(lambda t: _nested(*t)),
    st.integers(4290, 6000).map(lambda n: b'{"prompt": "x", "max_tokens": ' + b"7" * n + b"}"),
    st.integers(MAX_BODY - 64, MAX_BODY + 64).map(lambda n: b'{"prompt": "' + b"y" * n + b'"}'),
    st.sampled_from([b"", b"null", b"{}", b"[]", b'"x"', b"NaN", b"{'prompt': 'single quotes'}", b'{"prompt": "x"',
                     b'\xef\xbb\xbf{"prompt": "bom"}', b'{"prompt": "x", "prompt": [1, 2]}', b"\xff\xfe{\x00}\x00"]),
)


@st.composite
def mutated_valid_body(draw):
    """A valid body's JSON with a few bytes changed, cut short or repeated."""
    chat = draw(st.booleans())
    body = ({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": CAP} if chat
            else {"prompt": "hello there", "max_tokens": CAP, "temperature": 0.5})
    raw = bytearray(_dumps(body))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["flip", "cut", "dup", "insert"]))
        if op == "flip":
            raw[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del raw[i:]
            if not raw:
                break
        elif op == "dup":
            raw[i:i] = raw[i:i + draw(st.integers(1, 8))]
        else:
            raw[i:i] = draw(st.binary(min_size=1, max_size=4))
    return chat, bytes(raw)


@settings(FUZZ, max_examples=350)
@given(case=st.one_of(st.tuples(st.booleans(), raw_bodies), mutated_valid_body()), content_type=content_types)
def test_raw_garbage_bodies(http, oracle, case, content_type):
    chat, raw = case
    expected = predict(raw, chat, oracle)
    if expected is None:  # a mutation that still parses: keep it cheap
        body = cheap(json.loads(raw), chat, oracle)
        raw = _dumps(body)
        expected = predict(raw, chat, oracle)
    r = post(http, "/v1/chat/completions" if chat else "/v1/completions", raw, content_type)
    stream = expected is None and json.loads(raw).get("stream") is True
    check_response(r, expected, stream, "raw bodies", raw)


response_item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference", "x"]),
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", ""]),
    "content": st.one_of(any_text, st.lists(st.fixed_dictionaries(
        {}, optional={"type": st.sampled_from(["input_text", "output_text", "input_image", "x"]), "text": any_text}),
        max_size=2)),
    "call_id": any_text, "name": any_text, "arguments": any_text, "output": any_text,
})
RESPONSES = {
    "model": st.sampled_from([SERVED, "no-such-model"]),
    "input": st.one_of(any_text, st.lists(response_item, max_size=3)),
    "instructions": st.one_of(st.none(), any_text),
    "max_output_tokens": st.one_of(st.none(), st.integers(-5, 1 << 40)),
    "temperature": st.floats(allow_nan=True, allow_infinity=True),
    "previous_response_id": st.one_of(st.none(), any_text),
    "stream": st.booleans(),
    "store": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({}, optional={"type": st.sampled_from(["function", "web_search", ""]),
                                                          "name": any_text, "parameters": json_values}), max_size=2),
    "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["text", "json_schema", "json_object", "x"]), "schema": json_values,
        "name": any_text})}),
}
VALID_RESPONSES = {
    "model": st.just(SERVED),
    "input": st.one_of(st.text(max_size=40), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=40)}), min_size=1, max_size=2)),
    "instructions": st.one_of(st.none(), st.text(max_size=40)),
    "max_output_tokens": st.integers(1, CAP),
    "stream": st.booleans(),
    "store": st.booleans(),
}


@settings(FUZZ, max_examples=150)
@given(body=bodies(RESPONSES, VALID_RESPONSES, "input"), content_type=content_types)
def test_responses_bodies(http, oracle, body, content_type):
    """Any body to the Responses API is answered below 500 (a 4xx naming its problem); one
    it takes is stored when asked, served back by its id and forgotten on DELETE."""
    if body.get("model") == SERVED:
        body = {**body, "model": oracle[0].name}
    if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > CAP:
        body["max_output_tokens"] = CAP  # keep it cheap: the 400s of its own are the unit tests'
    r = post(http, "/v1/responses", _dumps(body), content_type)
    CASES[("/v1/responses", str(r.status_code))] += 1
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text[:300]
        return
    if body.get("stream") is True or body.get("store") is False:
        return
    rid = r.json()["id"]
    assert http.get(f"/v1/responses/{rid}").json()["id"] == rid
    assert http.delete(f"/v1/responses/{rid}").status_code == 200
    assert http.get(f"/v1/responses/{rid}").status_code == 404


ROUTES = {("GET", "/health"), ("GET", "/v1/models"), ("GET", "/openapi.json"), ("GET", "/version"),
          ("GET", "/status"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/responses"),
          ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}")}
paths = st.one_of(
    st.sampled_from(sorted({p for _, p in ROUTES if "{" not in p} | {"/", "/v1", "/v1/", "/v1/models/x", "/docs", "/redoc",
                                                    "/v1/completions/../models", "/%2e%2e/%2e%2e/etc/passwd",
                                                    "/v1/models?x=1&x=2", "/health#frag", "//v1//models",
                                                    "/v1/responses/resp_x", "/v1/responses/%00"})),
    st.text(alphabet="abc/%.?&=#-_~", max_size=30).map(lambda s: "/" + s),
)
header_values = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                        max_size=60)


def test_the_app_serves_exactly_the_fuzzed_routes(http):
    """Every route the live app has (its OpenAPI document lists them) is fuzzed here."""
    doc = http.get("/openapi.json").json()
    served = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops} | {("GET", "/openapi.json")}
    assert served == ROUTES, f"new routes to fuzz: {served - ROUTES}; gone: {ROUTES - served}"


@settings(FUZZ, max_examples=250)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"]),
    path=paths,
    params=st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
    headers=st.dictionaries(
        st.sampled_from(["authorization", "content-type", "accept", "x-api-key", "content-encoding",
                         "x-forwarded-for"]),
        header_values, max_size=3),
    body=st.one_of(st.just(b""), st.binary(max_size=100), json_values.map(_dumps)),
)
def test_any_method_path_query_and_headers(http, method, path, params, headers, body):
    try:
        headers = {k: v.strip(" \t").encode("latin-1") for k, v in headers.items()}  # h11 sends no edge spaces
        request = http.build_request(method, path, params=params, headers=headers, content=body)
    except (httpx.InvalidURL, ValueError, UnicodeError):  # the client won't send it
        return
    if (method, request.url.path) in {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}:
        body_ok = False
        try:
            body_ok = isinstance(json.loads(body), dict)
        except ValueError:
            pass
        if body_ok:
            return  # the body tests cover these (and a valid one may be expensive)
    try:
        r = http.send(request)
    except httpx.LocalProtocolError:  # the client won't send it
        return
    CASES[("method/path/headers", str(r.status_code))] += 1
    assert r.status_code < 500, f"{method} {request.url}: {r.status_code} {r.text[:300]}"
    if (method, request.url.path) in ROUTES and method == "GET":
        assert r.status_code == 200, (request.url, r.text[:200])
    elif r.status_code >= 400 and method != "HEAD":
        assert r.json()["error"]["message"], r.text


@settings(FUZZ, max_examples=100)
@given(
    head=st.one_of(
        st.binary(min_size=1, max_size=200),
        st.sampled_from([b"GET / HTTP/1.1\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: -5\r\n\r\n{}", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
                         b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n",
                         b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"]),  # a TLS ClientHello on the plain port
        st.binary(max_size=100).map(lambda b: b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b + b"\r\n\r\n"),
    ),
)
def test_garbage_on_the_raw_socket(service, head):
    host, port = service.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            reply = b""
        except OSError as e:  # the server closed first (an oversized head): nothing more to say
            if e.errno != errno.ENOTCONN:
                raise
            reply = b""
    status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "closed"
    CASES[("raw socket", status)] += 1
    assert not status.startswith("5"), reply[:300]


def test_still_serving_after_the_fuzz_run(http):
    r = http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200
    assert not any(outcome.startswith("5") for _, outcome in CASES), CASES
