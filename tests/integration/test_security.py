"""Security properties of the router on a live service: authentication on every API
call (HTTP and gRPC, streaming included) with a constant-time key comparison, bounds
on body and prompt sizes, no prompts or outputs in any log, and loopback binds.

One service for the module (1 prefill + 1 decode worker, tiny model) with an API key
and a 16 KiB body limit. tests/integration/test_router_grpc.py already checks that
GetModelInfo and GET /v1/models refuse a missing or wrong key and that /health and the
gRPC health check stay open; here every endpoint and method is covered, with more
kinds of wrong key, and the order of checks. Every test ends with no KV blocks in use.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.tandem.v1 import generate_pb2 as pb
from router.server import RouterConfig
from tests.helpers import PATIENCE_S, wait_for

API_KEY = "sec-" + uuid.uuid4().hex
MAX_BODY = 16 * 1024
WRONG_KEYS = ["wrong", API_KEY + "x", API_KEY[:-1], API_KEY.upper(), " " + API_KEY[1:], API_KEY[::-1]]


pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    return {"router": RouterConfig(api_key=API_KEY, max_body_bytes=MAX_BODY)}


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def http_calls():
    """(name, method, path, json body, streaming) for every API endpoint."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    completion = {"prompt": "hello", "max_tokens": 3}
    return [
        ("models", "GET", "/v1/models", None, False),
        ("version", "GET", "/version", None, False),
        ("tokenize", "POST", "/tokenize", {"prompt": "hello"}, False),
        ("detokenize", "POST", "/detokenize", {"tokens": [1, 2]}, False),
        ("completions", "POST", "/v1/completions", completion, False),
        ("completions stream", "POST", "/v1/completions", {**completion, "stream": True}, True),
        ("chat", "POST", "/v1/chat/completions", chat, False),
        ("chat stream", "POST", "/v1/chat/completions", {**chat, "stream": True}, True),
    ]


def assert_401(r) -> None:
    assert r.status_code == 401, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error
    assert API_KEY not in r.text


# -- authentication --------------------------------------------------------------------


def test_every_http_endpoint_refuses_a_missing_or_wrong_key_and_takes_the_right_one(http):
    for name, method, path, body, streaming in http_calls():
        for headers in [{}, {"x-api-key": API_KEY}, {"authorization": f"Basic {API_KEY}"}, {"authorization": "Bearer"}] + [
            bearer(k) for k in WRONG_KEYS
        ]:
            assert_401(http.request(method, path, json=body, headers=headers))
        r = http.request(method, path, json=body, headers=bearer(API_KEY))
        assert r.status_code == 200, (name, r.text[:300])
        if streaming:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, (name, r.text[-300:])
    # the key is checked before the body is read or validated, and before admission
    assert_401(http.post("/v1/completions", content=b"{not json"))
    assert_401(http.post("/v1/completions", content=b"x" * (MAX_BODY + 1)))
    assert_401(http.post("/v1/chat/completions", json={"messages": "nope", "temperature": -1}))


def _grpc_code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_grpc_method_refuses_a_missing_or_wrong_key_and_takes_the_right_one(channel, stub):
    request = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=3))
    methods = {
        "Generate": lambda md: list(stub.Generate(request, metadata=md, timeout=30)),
        "Abort": lambda md: stub.Abort(pb.AbortRequest(request_id="nope"), metadata=md, timeout=10),
        "GetModelInfo": lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10),
    }
    wrong = [None, [("x-api-key", "wrong")], [("authorization", "Basic " + API_KEY)]] + [
        [("authorization", f"Bearer {k}")] for k in WRONG_KEYS
    ] + [[("x-api-key", k)] for k in WRONG_KEYS]
    for name, fn in methods.items():
        for md in wrong:
            assert _grpc_code(lambda: fn(md)) == grpc.StatusCode.UNAUTHENTICATED, (name, md)
        for md in ([("authorization", f"Bearer {API_KEY}")], [("x-api-key", API_KEY)]):
            assert _grpc_code(lambda: fn(md)) == grpc.StatusCode.OK, (name, md)
    # the key is checked before the request is parsed or validated
    raw = channel.unary_stream("/tandem.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    assert _grpc_code(lambda: list(raw(b"\xff\xff garbage", timeout=10))) == grpc.StatusCode.UNAUTHENTICATED
    bad = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1.0))
    assert _grpc_code(lambda: list(stub.Generate(bad, timeout=10))) == grpc.StatusCode.UNAUTHENTICATED


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                   max_size=80))
def test_random_keys_are_refused_on_both_transports_and_never_break_the_server(http, stub, key):
    if key.strip() == API_KEY:
        return
    r = http.get("/v1/models", headers={"authorization": (b"Bearer " + key.encode("latin-1")).strip()})
    assert_401(r)
    ascii_key = key.encode("ascii", "replace").decode()
    for md in ([("authorization", f"Bearer {ascii_key}")], [("x-api-key", ascii_key)]):
        code = _grpc_code(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED, (md, code)


def test_the_key_comparison_is_constant_time(monkeypatch):
    """Every key check goes through hmac.compare_digest (no == on the secret)."""
    import hmac

    import router.validation as validation
    from router.errors import ApiError
    from router.validation import check_api_key

    calls, real = [], hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(validation.hmac, "compare_digest", spy)
    check_api_key("k3y", "k3y")
    for presented in ("k3x", "k3", "k3y-longer", "", "ÿ"):
        with pytest.raises(ApiError) as e:
            check_api_key("k3y", presented)
        assert e.value.status == 401
    assert len(calls) == 6 and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
    with pytest.raises(ApiError):
        check_api_key("k3y", None)
    check_api_key(None, None)  # no key configured: open


# -- size bounds -----------------------------------------------------------------------


def test_bodies_over_the_limit_get_413_however_they_are_sent(http, stub):
    auth = bearer(API_KEY)
    body = json.dumps({"prompt": "y" * MAX_BODY, "max_tokens": 2}).encode()
    r = http.post("/v1/completions", content=body, headers=auth)  # with Content-Length
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"], r.text

    def chunks():  # chunked: no Content-Length; the router stops reading past the limit
        for i in range(0, len(body), 1024):
            yield body[i:i + 1024]

    r = http.post("/v1/completions", content=chunks(), headers=auth)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions", content=chunks(), headers=auth)
    assert r.status_code == 413, r.text
    # just under the limit is read (and here rejected for its length, not its size)
    under = json.dumps({"prompt": "y" * (MAX_BODY - 100), "max_tokens": 2}).encode()
    assert len(under) <= MAX_BODY
    r = http.post("/v1/completions", content=under, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    # gRPC: Serve's servers refuse messages over its limit unread (1 MiB, the default body
    # limit); the router refuses one over its own, smaller here, with the same code
    big = pb.GenerateRequest(text="y" * MAX_BODY, sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(big, metadata=list(auth.items()), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(MAX_BODY) in e.value.details()


def test_prompts_longer_than_the_context_get_400_naming_the_limit(http, stub, service):
    auth = bearer(API_KEY)
    context = service.model_info["max_model_len"]
    cases = [
        ("/v1/completions", {"prompt": [5] * context, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [5] * (context - 1), "max_tokens": 2}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * context}]}, "messages"),
    ]
    for path, body, param in cases:
        r = http.post(path, json=body, headers=auth)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and str(context) in error["message"], error
        assert "max_model_len" in error["message"], error
    with pytest.raises(grpc.RpcError) as e:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * (context + 10)))
        list(stub.Generate(request, metadata=list(auth.items()), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in e.value.details() and str(context) in e.value.details(), e.value.details()


# -- logs ------------------------------------------------------------------------------


def _log_files() -> list[Path]:
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file()]


def _files_holding(needles: list[bytes]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _log_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for needle in needles:
            if needle in data:
                found.setdefault(needle.decode(errors="replace"), []).append(str(path))
    return found


def _router_access_lines() -> int:
    """How many times the router replicas' logs name /v1/completions."""
    return sum(p.read_bytes().count(b"/v1/completions") for p in _log_files() if "Router" in p.name)


def test_prompts_and_outputs_are_not_logged(http, stub, caplog, capfd):
    import ray

    caplog.set_level(logging.DEBUG)
    access_lines_before = _router_access_lines()
    marker = f"PROMPT-MARKER-{uuid.uuid4().hex}"
    auth = bearer(API_KEY)
    outputs = []
    # accepted, over both transports, whole and streamed
    for body in ({"prompt": f"{marker} tell me", "max_tokens": 16, "ignore_eos": True},
                 {"prompt": f"{marker} stream", "max_tokens": 16, "ignore_eos": True, "stream": True}):
        r = http.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        if not body.get("stream"):
            outputs.append(r.json()["choices"][0]["text"])
    r = http.post("/v1/chat/completions", headers=auth,
                  json={"messages": [{"role": "user", "content": marker}], "max_tokens": 16})
    assert r.status_code == 200, r.text
    outputs.append(r.json()["choices"][0]["message"]["content"])
    request = pb.GenerateRequest(text=marker, sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True))
    outputs.append("".join(m.text for m in stub.Generate(request, metadata=list(auth.items()), timeout=30)))
    # refused: invalid, unauthenticated, too long, unknown model
    refused = [
        ({"prompt": marker, "temperature": -1}, auth),
        ({"prompt": marker, "max_tokens": 2}, bearer("wrong")),
        ({"prompt": f"{marker} " * 300, "max_tokens": 2}, auth),
        ({"prompt": marker, "model": marker}, auth),
        ({"messages": [{"role": marker, "content": marker}]}, auth),
    ]
    for body, headers in refused:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert 400 <= http.post(path, json=body, headers=headers).status_code < 500
    for bad in (pb.GenerateRequest(text=marker, sampling=pb.SamplingParams(top_p=7.0)),
                pb.GenerateRequest(text=marker, model="no-such-model")):
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(bad, metadata=list(auth.items()), timeout=30))

    # A control: text that a Ray worker does log must show up in the files scanned.
    control = f"LOG-CONTROL-{uuid.uuid4().hex}"

    @ray.remote(num_cpus=0)
    def log_it(text):
        logging.getLogger("tandem.test").warning(text)
        print(text, flush=True)

    ray.get(log_it.remote(control))
    needles = [marker.encode()] + [o.encode() for o in outputs if len(o) >= 24]
    # Scan once the logs have caught up: they hold the control line, written last, and
    # the router's own access lines for the two completions above (its log is scanned too).
    wait_for(
        lambda: _files_holding([control.encode()]) and _router_access_lines() >= access_lines_before + 2,
        PATIENCE_S, "the control line and the router's access lines in the Ray logs (none: wrong folder?)", every_s=0.5,
    )
    found = _files_holding(needles)
    assert not found, f"prompt or output text found in logs: {found}"
    assert marker not in caplog.text
    out, err = capfd.readouterr()
    assert marker not in out and marker not in err
    print(f"scanned {len(_log_files())} log files; {len(needles)} prompt/output strings, none found")


# -- binds -----------------------------------------------------------------------------


def _listeners(port: int) -> set[str]:
    """The addresses listening on ``port`` (this driver started Ray: its processes descend from it)."""
    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.AccessDenied:
        conns = []
        for proc in psutil.Process().children(recursive=True):
            try:
                conns += proc.net_connections(kind="inet")
            except psutil.Error:
                pass
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def test_http_binds_loopback_by_default(service):
    from cluster.service import ServiceConfig
    from tandem.cli import build_parser

    assert ServiceConfig().host == "127.0.0.1"
    assert build_parser().parse_args(["up"]).host == "127.0.0.1"
    http_port, grpc_port = service.config.http_port, service.config.grpc_port
    http, grpc_listeners = _listeners(http_port), _listeners(grpc_port)
    assert http == {"127.0.0.1"}, f"HTTP listens on {http}"
    if service.config.ingress == "haproxy":  # HAProxy's gRPC frontend binds the HTTP host
        assert grpc_listeners == {"127.0.0.1"}, f"gRPC listens on {grpc_listeners}"
    # Known limit (docs/SECURITY.md): Serve's gRPC proxy, with --ingress proxy, binds every interface.
    print(f"HTTP listens on {sorted(http)}:{http_port}; gRPC on {sorted(grpc_listeners)}:{grpc_port}")
