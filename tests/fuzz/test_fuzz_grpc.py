"""Fuzzing the gRPC API of a live service with hypothesis.

One service for both fuzz modules (1 prefill + 1 decode worker, tiny model, a 64 KiB
request limit). Every method (``tandem.v1.Generation`` Generate / Abort / GetModelInfo
and ``grpc.health.v1.Health/Check``) gets generated requests: randomly populated
messages with values over each field's whole wire range (uint32 / uint64 extremes, NaN
and infinities, out-of-vocabulary token ids, odd unicode, long strings), hand-built wire
messages (any field number with any wire type), raw garbage bytes and mutated valid
serializations, all sent through a generic ``unary_stream`` / ``unary_unary`` call with
an identity serializer, so the server gets exactly those bytes.

The oracle: bytes that do not parse as the method's message must get INVALID_ARGUMENT;
a GenerateRequest gets what the router's validation says locally
(``router.grpc_api.prepare`` with the served model's limits and tokenizer) as a status
code, and an accepted one a well-formed stream (cheap: ``max_tokens`` is set to
``CAP``). The oracle runs the router's check of a structured-output spec too (its
bounds, then xgrammar's parse: ``tests.fuzz.conftest.check_grammar``). Never INTERNAL or
UNKNOWN. Counts are printed (``-s``) and written to ``fuzz-grpc.json`` in the session's
temp folder.

Hostile requests (issue 53: grammar bombs, JSON text nested deeper than the decoder
goes, stop lists and prompts past their limits; ``HOSTILE``) are drawn among the random
ones, as patches on valid requests and as single fields' values, and each is also sent
once by itself (``test_each_hostile_request_gets_its_answer_at_once``): its status code,
the limit its details name, within ``ANSWER_S``.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.grpc.health.v1 import health_pb2
from protos.tandem.v1 import generate_pb2 as pb
from router import grpc_api
from router.errors import ApiError
from tests.fuzz.conftest import MAX_BODY, check_grammar
from tests.helpers import tally, write_report

CAP = 4
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
CASES: Counter = Counter()  # (test, status code name) -> calls made
ANSWERED_S: dict[str, float] = {}  # hostile request sent by itself -> seconds to its answer
SERVED = "<the served model's name>"
GENERATE = "/tandem.v1.Generation/Generate"
UNARY = {
    "/tandem.v1.Generation/Abort": pb.AbortRequest,
    "/tandem.v1.Generation/GetModelInfo": pb.GetModelInfoRequest,
    "/grpc.health.v1.Health/Check": health_pb2.HealthCheckRequest,
}
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module", autouse=True)
def report(tmp_path_factory):
    yield
    by_test, total = tally(CASES), sum(CASES.values())
    bad = sum(n for (_, outcome), n in CASES.items() if outcome in {c.name for c in NEVER})
    path = write_report(tmp_path_factory, "fuzz-grpc.json", {"total": total, "internal_or_unknown": bad, "by_test": by_test})
    print(f"\ngRPC fuzz: {total} calls, {bad} INTERNAL/UNKNOWN; by test and code: {by_test} ({path})")
    if ANSWERED_S:
        slowest = max(ANSWERED_S, key=ANSWERED_S.__getitem__)
        print(f"hostile requests: {len(ANSWERED_S)} answered, the slowest in {ANSWERED_S[slowest]:.3f}s ({slowest})")


def _identity(b: bytes) -> bytes:
    return b


def call(channel, method: str, payload: bytes, test: str):
    """(status code, responses) of the call with exactly these request bytes."""
    if method == GENERATE or method.endswith("/Watch"):
        rpc = channel.unary_stream(method, request_serializer=_identity, response_deserializer=_identity)
        try:
            out = list(rpc(payload, timeout=60))
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            out, code, details = [], e.code(), e.details()
    else:
        rpc = channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)
        try:
            out = [rpc(payload, timeout=60)]
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            out, code, details = [], e.code(), e.details()
    CASES[(test, code.name)] += 1
    assert code not in NEVER, f"{method} {payload[:200]!r}: {code} {details}"
    return code, details, out


# -- the oracle ----------------------------------------------------------------


def predict_generate(request: pb.GenerateRequest, oracle) -> ApiError | None:
    """What the router says of ``request`` before admission (its size, its validation,
    its check of an output constraint): the ApiError, or None (accepted)."""
    model, tokenizer = oracle
    try:
        if request.ByteSize() > MAX_BODY:
            raise ApiError(413, "over the limit")
        check_grammar(grpc_api.prepare(request, model, tokenizer))
    except ApiError as e:
        return e
    return None


def cheap(request: pb.GenerateRequest, oracle) -> pb.GenerateRequest:
    """The served model's name in; max_tokens CAP when the router would accept it."""
    if request.model == SERVED:
        request.model = oracle[0].name
    if predict_generate(request, oracle) is None:
        request.sampling.max_tokens = CAP
    return request


def check_generate(channel, request: pb.GenerateRequest, oracle, test: str) -> tuple[grpc.StatusCode, str, float]:
    """Send ``request`` and judge the answer by the oracle; (its code, details, seconds)."""
    expected = predict_generate(request, oracle)
    start = time.monotonic()
    code, details, out = call(channel, GENERATE, request.SerializeToString(), test)
    took = time.monotonic() - start
    if expected is not None:
        want = grpc_api.status_code(expected)
        assert code == want, (code, details, expected.message)
        assert details, code
        if expected.param:
            assert expected.param.split(".")[0] in details, (details, expected.param)
        return code, details, took
    assert code == grpc.StatusCode.OK, (code, details)
    messages = [pb.GenerateResponse.FromString(m) for m in out]
    n = request.sampling.n if request.sampling.HasField("n") else 1
    assert {m.index for m in messages} == set(range(n)), ([m.index for m in messages], n)
    for i in range(n):
        mine = [m for m in messages if m.index == i]
        assert mine[-1].finished and mine[-1].finish_reason in ("length", "stop"), (i, mine[-1:])
        assert 1 <= mine[-1].usage.completion_tokens <= CAP
        assert not any(m.finished for m in mine[:-1])
    return code, details, took


# -- strategies ----------------------------------------------------------------

U32 = 2**32 - 1
u32 = st.one_of(st.integers(0, 64), st.integers(0, U32), st.sampled_from([0, 1, 4095, 4096, 2**31, U32]))
u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1]))
doubles = st.one_of(
    st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, 5e-324, 1e308]),
)
texts = st.one_of(
    st.text(max_size=40),  # protobuf strings are UTF-8: no lone surrogates
    st.sampled_from(["", "\x00", "\u202eevil\u202c", "שלום", "\U0001f600\u200d", "\ufeff", "<s>", "</s>",
                     "a" * 3000, "word " * 700, "x" * (MAX_BODY + 10)]),
)
token_ids = st.lists(st.one_of(st.integers(0, 4095), st.integers(4090, 4200), u32), max_size=40)


# -- hostile requests (issue 53) -------------------------------------------------
# Each once cost a service seconds to minutes of a grammar parse that nothing stops, or
# its event loop: a patch on a valid request, with the answer it must get.


@dataclass(frozen=True)
class Hostile:
    """A patch (``text``: the prompt; other keys: SamplingParams fields) and the answer it
    must get: ``code``, and ``says``, a part of the details (the field or the limit)."""

    patch: dict
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    says: str = ""


BOMB = json.dumps({"type": "string", "pattern": "[a-z]{1,20000}"})  # 36 s of xgrammar's parse, unbounded
HOSTILE = {
    "schema bomb": Hostile({"guided_json": BOMB}, says="(max_regex_size)"),
    "guided_json nested 20000 deep": Hostile({"guided_json": "[" * 20_000 + "]" * 20_000},
                                             says="guided_json is not valid JSON: nested too deeply"),
    "response_format nested 900 deep": Hostile(
        {"response_format": '{"type":"json_schema","json_schema":{"schema":{"a":' + "[" * 900 + "]" * 900 + "}}}"},
        says="response_format"),
    "response_format with nested repeats": Hostile(
        {"response_format": json.dumps({"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "(a{1,100}){1,100}"}}})},
        says="(max_regex_size)"),
    "guided_regex repeating 5000 times": Hostile({"guided_regex": "[a-z]{1,5000}"}, says="(max_regex_size)"),
    "16 stop strings": Hostile({"stop": ["x"] * 16}, grpc.StatusCode.OK),
    "17 stop strings": Hostile({"stop": ["x"] * 17}, says="stop has 17 strings, over the limit of 16"),
    "128 stop_token_ids": Hostile({"stop_token_ids": [1] * 128}, grpc.StatusCode.OK),
    "129 stop_token_ids": Hostile({"stop_token_ids": [1] * 129}, says="stop_token_ids has 129"),
    "a prompt of 40000 characters": Hostile({"text": "x" * 40_000}, says="prompt has 40000 characters"),
}


def hostile_values(name: str) -> list:
    """The values the hostile requests give field ``name``: drawn among its random ones."""
    return [h.patch[name] for h in HOSTILE.values() if name in h.patch]


def patched(request: pb.GenerateRequest, patch: dict) -> pb.GenerateRequest:
    """``request`` with the patch's fields set in place of its own."""
    fields = dict(patch)
    if "text" in fields:
        request.text = fields.pop("text")
    for name in fields:
        request.sampling.ClearField(name)
    request.sampling.MergeFrom(pb.SamplingParams(**fields))
    return request


sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.none(), st.integers(0, 8), u32),
    temperature=st.one_of(st.none(), doubles),
    top_p=st.one_of(st.none(), doubles),
    top_k=st.one_of(st.none(), u32),
    min_p=st.one_of(st.none(), doubles),
    repetition_penalty=st.one_of(st.none(), doubles),
    presence_penalty=st.one_of(st.none(), doubles),
    frequency_penalty=st.one_of(st.none(), doubles),
    seed=st.one_of(st.none(), u64),
    stop=st.one_of(st.lists(texts, max_size=3), st.sampled_from(hostile_values("stop"))),
    stop_token_ids=st.one_of(st.lists(u32, max_size=3), st.sampled_from(hostile_values("stop_token_ids"))),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 25), u32),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 25), u32),
    n=st.one_of(st.none(), st.integers(0, 20), u32),
    min_tokens=st.one_of(st.integers(0, 4), u32),
    logit_bias=st.dictionaries(u32, doubles, max_size=3),
    allowed_token_ids=token_ids,
    bad_words=st.lists(texts, max_size=3),
    guided_json=st.one_of(st.none(), texts, st.sampled_from(hostile_values("guided_json"))),
    guided_regex=st.one_of(st.none(), texts, st.sampled_from(hostile_values("guided_regex"))),
    response_format=st.one_of(st.none(), texts, st.sampled_from(hostile_values("response_format"))),
)
valid_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.none(), st.integers(1, 8)),
    temperature=st.one_of(st.none(), st.floats(0, 2)),
    top_p=st.one_of(st.none(), st.floats(0.01, 1)),
    top_k=st.one_of(st.none(), u32),
    seed=st.one_of(st.none(), u64),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=2),
    stop_token_ids=st.lists(st.integers(0, 4095), max_size=3),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 20)),
    n=st.one_of(st.none(), st.integers(1, 3)),
    min_tokens=st.integers(0, 3),
    logit_bias=st.dictionaries(st.integers(0, 4095), st.floats(-100, 100), max_size=3),
    allowed_token_ids=st.lists(st.integers(0, 4095), max_size=5),
    bad_words=st.lists(st.text(min_size=1, max_size=6).filter(str.strip), max_size=3),
)


@st.composite
def generate_requests(draw):
    valid = draw(st.booleans())
    kwargs = {
        "request_id": draw(texts),
        "model": draw(st.sampled_from([SERVED, ""]) if valid else st.one_of(st.sampled_from([SERVED, ""]), texts)),
        "sampling": draw(valid_sampling if valid else sampling),
    }
    prompt = draw(st.sampled_from(["text", "token_ids"] if valid else ["text", "token_ids", "none"]))
    if prompt == "text":
        kwargs["text"] = draw(st.text(min_size=1, max_size=60) if valid else texts)
    elif prompt == "token_ids":
        ids = st.lists(st.integers(0, 4095), min_size=1, max_size=30) if valid else token_ids
        kwargs["token_ids"] = pb.TokenIds(ids=draw(ids))
    if not draw(st.integers(0, 9)):
        del kwargs["sampling"]
    request = pb.GenerateRequest(**kwargs)
    if valid and not draw(st.integers(0, 4)):
        patched(request, draw(st.sampled_from(list(HOSTILE.values()))).patch)
    return request


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def wire_messages(draw, depth: int = 0):
    """Well-framed protobuf wire data: any field number with any wire type and payload."""
    out = b""
    for _ in range(draw(st.integers(0, 6))):
        field = draw(st.one_of(st.integers(1, 15), st.integers(1, 2**29 - 1)))
        wire = draw(st.sampled_from([0, 1, 2, 5, 3, 4, 6, 7]))
        out += _varint(field << 3 | wire)
        if wire == 0:
            out += _varint(draw(st.integers(0, 2**64 - 1)))
        elif wire == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wire == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        elif wire == 2:
            nested = depth < 3 and draw(st.booleans())
            payload = draw(wire_messages(depth + 1) if nested else st.binary(max_size=30))
            out += _varint(len(payload)) + payload
    return out


@st.composite
def mutated(draw, message):
    raw = bytearray(draw(message).SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            raw[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(raw)


garbage = st.one_of(
    st.binary(max_size=200),
    wire_messages(),
    mutated(generate_requests()),
    st.sampled_from([b"", b"\x00", b"\xff" * 20, b"\x1a\x03\xff\xfe\xfd", b"\x22\x05\x0a\x03\xff\xff\xff",
                     b"\x0a" + _varint(2**31) + b"x", b"\x2a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                     b"\x22\x02" * 2000]),
)


# -- the tests -----------------------------------------------------------------


@settings(FUZZ, max_examples=600)
@given(request=generate_requests())
def test_generate_with_random_messages(channel, oracle, request):
    check_generate(channel, cheap(request, oracle), oracle, "Generate messages")


@settings(FUZZ, max_examples=400)
@given(payload=garbage)
def test_generate_with_raw_bytes(channel, oracle, payload):
    try:
        request = pb.GenerateRequest.FromString(payload)
    except Exception:
        code, details, _ = call(channel, GENERATE, payload, "Generate bytes")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in details, (code, details)
        return
    check_generate(channel, cheap(request, oracle), oracle, "Generate bytes")


ANSWER_S = 2.0  # a refusal here takes milliseconds; unbounded, the grammar cases took 10 s to minutes


def small_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=1))


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_hostile_request_gets_its_answer_at_once(channel, oracle, name):
    """Each hostile request by itself: its code and the limit its details name, within ANSWER_S."""
    case = HOSTILE[name]
    request = patched(small_request(), case.patch)
    expected = predict_generate(request, oracle)
    predicted = grpc.StatusCode.OK if expected is None else grpc_api.status_code(expected)
    assert predicted == case.code, f"the oracle says {predicted}: {expected and expected.message}"
    code, details, ANSWERED_S[name] = check_generate(channel, request, oracle, "hostile")
    if code != grpc.StatusCode.OK:
        assert case.says in details, (case.says, details)
        assert ANSWERED_S[name] < ANSWER_S, f"answered in {ANSWERED_S[name]:.2f}s, over {ANSWER_S}s"


def test_a_prompt_past_the_character_bound_is_refused_before_tokenizing(channel, oracle):
    """A text one character over (max_model_len - 1) * max_chars_per_token: INVALID_ARGUMENT
    counting characters, not tokens."""
    most = oracle[0].max_prompt_chars
    assert most is not None, "the tiny model's tokenizer bounds the characters of a token"
    request = small_request()
    request.text = "x" * (most + 1)
    name = f"a prompt past {most} characters"
    code, details, ANSWERED_S[name] = check_generate(channel, request, oracle, "hostile")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"prompt has {most + 1} characters" in details, details
    assert ANSWERED_S[name] < ANSWER_S, f"answered in {ANSWERED_S[name]:.2f}s, over {ANSWER_S}s"


@settings(FUZZ, max_examples=400)
@given(
    method=st.sampled_from(sorted(UNARY)),
    payload=st.one_of(garbage, st.builds(pb.AbortRequest, request_id=texts).map(lambda m: m.SerializeToString())),
)
def test_unary_methods_with_raw_bytes(channel, method, payload):
    try:
        UNARY[method].FromString(payload)
        parses = True
    except Exception:
        parses = False
    code, details, out = call(channel, method, payload, method.rsplit("/", 1)[1])
    if not parses:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        return
    if method.endswith("/Abort") and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert "aborts.per_s" in details, details  # past the replica's budget of Aborts passed to every worker
        return
    assert code == grpc.StatusCode.OK, (code, details)
    if method.endswith("/Abort"):
        assert not pb.AbortResponse.FromString(out[0]).found  # nothing runs in between examples
    elif method.endswith("/Check"):
        assert health_pb2.HealthCheckResponse.FromString(out[0]).status == health_pb2.HealthCheckResponse.SERVING
    else:
        assert pb.ModelInfo.FromString(out[0]).max_model_len > 0


@settings(FUZZ, max_examples=40)
@given(
    method=st.one_of(
        st.sampled_from(["/grpc.health.v1.Health/Watch", "/tandem.v1.Generation/Nope", "/tandem.v1.Other/Generate"]),
        st.text(alphabet="abcXYZ./_", min_size=1, max_size=30).map(lambda s: "/" + s),
    ),
    payload=st.binary(max_size=20),
)
def test_unknown_methods_are_unimplemented(channel, method, payload):
    code, details, _ = call(channel, method, payload, "unknown methods")
    assert code == grpc.StatusCode.UNIMPLEMENTED, (method, code, details)


def test_still_serving_after_the_fuzz_run(channel):
    from protos.grpc.health.v1 import health_pb2_grpc
    from protos.tandem.v1 import generate_pb2_grpc

    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    stub = generate_pb2_grpc.GenerationStub(channel)
    request = pb.GenerateRequest(text="still serving", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
    messages = list(stub.Generate(request, timeout=30))
    assert messages[-1].finished and messages[-1].usage.completion_tokens == 3
    assert not any(code in {c.name for c in NEVER} for _, code in CASES), CASES
