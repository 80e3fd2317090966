"""The work a router replica does before admission (reading the body, validating it,
rendering the chat, tokenizing), through the replica's own handlers without Ray: it runs
off the event loop, within the intake bounds, and a prompt far over the context is
refused before the tokenizer sees it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest
from starlette.requests import Request

from protos.tandem.v1 import generate_pb2 as pb
from router.admission import IntakeConfig
from router.core import RouterConfig, RouterCore
from router.errors import ApiError
from router.server import Router
from router.tokenization import tokenize

WAIT_S = 2.0  # how long a blocked encode waits for the test: past it, the loop was not free
CHAT = [{"role": "user", "content": "hello"}]


class BlockingTokenizer:
    """The real tokenizer, except that ``encode`` waits until the test releases it and then
    gives no tokens (every request ends with a 400 for its empty prompt: nothing runs)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.chat_template = inner.chat_template
        self.entered = threading.Event()
        self.release = threading.Event()
        self.waited_out = 0  # encodes that no one released within WAIT_S

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)

    def encode(self, text, add_special_tokens=True):
        self.entered.set()
        if not self.release.wait(WAIT_S):
            self.waited_out += 1
        return []


class RefusingTokenizer(BlockingTokenizer):
    """A tokenizer that must not be asked to encode anything."""

    def encode(self, text, add_special_tokens=True):
        raise AssertionError(f"encode was called with {len(text)} characters")


class GrpcContext:
    """The little of a gRPC call's context the router reads: no metadata (no API key set)."""

    def invocation_metadata(self):
        return ()


def make_core(model_dir, config: RouterConfig | None = None) -> RouterCore:
    from engine.tokenizer import Tokenizer

    vocab = Tokenizer.from_pretrained(model_dir).vocab_size
    info = {"model_dir": str(model_dir), "name": "tiny", "max_model_len": 64, "vocab_size": vocab,
            "block_size": 16, "max_kv_blocks": 8}
    return RouterCore(None, config or RouterConfig(), info, ((), ()), {})


def router_on(core: RouterCore):
    """The Serve deployment's own class (under Serve's ingress wrapper) with ``core`` in
    place of a connected one."""
    router = object.__new__(Router.func_or_class.__bases__[0])
    router.core = core
    return router


def http_request(body: dict) -> Request:
    raw = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-length", str(len(raw)).encode())]}
    return Request(scope, receive)


ENTRIES = {
    "chat": lambda router, text: router._http(http_request({"messages": [{"role": "user", "content": text}]}),
                                              chat=True),
    "completions": lambda router, text: router._http(http_request({"prompt": text}), chat=False),
    "tokenize": lambda router, text: router._tokenizer_call(http_request({"prompt": text}), tokenize),
    "grpc": lambda router, text: router._grpc_prepare(pb.GenerateRequest(text=text), GrpcContext()),
}


async def _entered(tokenizer: BlockingTokenizer, handlers: list[asyncio.Task]) -> None:
    """Until a handler is in ``encode`` (or every handler ended without getting there)."""
    while not tokenizer.entered.is_set() and not all(h.done() for h in handlers):
        await asyncio.sleep(0.001)


async def _ended(handlers: list[asyncio.Task]) -> None:
    for handler in handlers:
        with contextlib.suppress(ApiError):
            await handler


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_the_event_loop_keeps_serving_while_a_request_is_tokenized(default_model, entry):
    core = make_core(default_model)
    tokenizer = core.tokenizer = BlockingTokenizer(core.tokenizer)
    router = router_on(core)

    async def scenario():
        handler = asyncio.create_task(ENTRIES[entry](router, "hello"))
        await _entered(tokenizer, [handler])
        tokenizer.release.set()  # runs while encode waits only if encode is off the loop
        await _ended([handler])

    asyncio.run(scenario())
    assert tokenizer.entered.is_set(), "the request never reached the tokenizer"
    assert tokenizer.waited_out == 0, f"{entry}: the event loop stalled while the request was tokenized"


def test_requests_past_the_intake_bound_get_a_429_naming_it_until_the_first_are_done(default_model):
    core = make_core(default_model, RouterConfig(intake=IntakeConfig(threads=1, max_requests=2)))
    tokenizer = core.tokenizer = BlockingTokenizer(core.tokenizer)
    router = router_on(core)

    async def scenario():
        first = [asyncio.create_task(ENTRIES["chat"](router, "hello")) for _ in range(2)]
        await _entered(tokenizer, first)  # one tokenizing, one waiting for the thread
        with pytest.raises(ApiError) as refused:
            await ENTRIES["chat"](router, "hello")
        tokenizer.release.set()
        await _ended(first)
        with pytest.raises(ApiError) as later:  # room again: validated (and its empty prompt refused)
            await ENTRIES["chat"](router, "hello")
        return refused.value, later.value

    refused, later = asyncio.run(scenario())
    assert (refused.status, refused.type) == (429, "rate_limit_error"), refused.message
    assert "max_intake_requests=2" in refused.message and refused.retry_after_s >= 1, refused.message
    assert later.status == 400 and later.param == "messages", later.message
    assert core.intake.requests == 0 and core.intake.bytes == 0


def test_a_client_gone_mid_tokenizing_holds_its_intake_place_until_the_thread_is_done(default_model):
    core = make_core(default_model, RouterConfig(intake=IntakeConfig(threads=1, max_requests=1)))
    tokenizer = core.tokenizer = BlockingTokenizer(core.tokenizer)
    router = router_on(core)

    async def scenario():
        handler = asyncio.create_task(ENTRIES["completions"](router, "hello"))
        await _entered(tokenizer, [handler])
        handler.cancel()  # the client went away: its tokenization still runs
        with contextlib.suppress(asyncio.CancelledError):
            await handler
        held = core.intake.requests
        tokenizer.release.set()
        for _ in range(int(WAIT_S * 1000)):
            if not core.intake.requests:
                break
            await asyncio.sleep(0.001)
        return held

    assert asyncio.run(scenario()) == 1, "the thread was still tokenizing: its place was still taken"
    assert core.intake.requests == 0, "the thread ended: its place is free"


@pytest.mark.parametrize("entry", ["chat", "completions", "grpc"])
def test_a_prompt_far_over_the_context_is_refused_before_the_tokenizer_sees_it(default_model, entry):
    core = make_core(default_model)
    core.tokenizer = RefusingTokenizer(core.tokenizer)
    with pytest.raises(ApiError) as refused:
        asyncio.run(ENTRIES[entry](router_on(core), "x" * 200_000))
    e, limit = refused.value, (core.model.max_model_len - 1) * core.model.max_chars_per_token
    param = "messages" if entry == "chat" else "prompt"
    assert (e.status, e.param, e.code) == (400, param, "context_length_exceeded"), e.message
    assert f"{limit} characters" in e.message and "max_model_len" in e.message, e.message
