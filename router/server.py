"""The router: one Ray Serve deployment serving the OpenAI HTTP API and the gRPC API.

HTTP (FastAPI ingress): ``POST /v1/completions``, ``POST /v1/chat/completions`` (with
``stream`` as server-sent events), OpenAI's Responses API (``POST /v1/responses``, run as a
chat completion: ``router.responses``; ``GET`` and ``DELETE /v1/responses/{id}`` of the
replica's stored ones: ``router.response_store``), ``GET /v1/models``, ``GET /health``,
and vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``. gRPC (Serve's
gRPC proxy, servicers from ``protos``): ``tandem.v1.Generation`` and
``grpc.health.v1.Health/Check``.

A request's way through a replica::

    auth ─▶ body read (413) ─▶ intake bound (429 / RESOURCE_EXHAUSTED) ─▶ parse + validate
      + render + tokenize on a tokenizer thread (4xx; ``RouterCore.prepare``) ─▶ output
      constraint parsed (400; helper process) ─▶ admission (429 / RESOURCE_EXHAUSTED)
      ─▶ Dispatcher.generate ─▶ deltas out as JSON, SSE chunks or gRPC messages
      ─▶ admission ticket released (finished, failed, aborted or client gone)

A chat request whose message is read as it streams, because it may call tools
(``PreparedRequest.tools``) or its thinking goes apart from its answer
(``PreparedRequest.reasoning``), streams through a path of its own (``sse_message``), so
that every other stream keeps the lean one (``sse_stream``); both, and the answer made
whole (``drain``) or of several choices (``sse_many``), are in ``router.http_streams``.

A request of several choices (a completions request with a list of prompts, and either
endpoint's or gRPC Generate's ``n`` > 1) is a request a choice
(``router.validation.choices``), admitted together (or refused together), run side by
side by ``Fanout`` and answered as one response whose choices (or interleaved chunks
or messages) carry each choice's index; a gRPC Abort of its id ends every choice. A
prompt is prefilled once: its first choice starts alone, the others once its first
delta came (the prompt's blocks are then cached), placed with it
(``router.dispatch.Affinity``).

A client that goes away cancels the handler; the dispatcher then aborts the request on
both workers. The replica learns the live workers from the cluster controller (an
actor handle passed in at bind time), refreshed every ``workers_refresh_s``.
"""


import importlib.metadata
import json
import logging
import time
import uuid
from contextlib import aclosing
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

# No ``from __future__ import annotations`` here: FastAPI must see real classes in the
# ingress methods' signatures (``Request``). Serve pickles the ingress class when it is
# decorated, so every helper it calls is defined above it or imported.
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from protos.grpc.health.v1 import health_pb2
from protos.tandem.v1 import generate_pb2 as pb
from router import grpc_api
from router.admission import Ticket
from router.bodies import parse_json
from router.chat_output import MessageStream, read_message
from router.core import RouterConfig, RouterCore
from router.dispatch import aborted_delta
from router.errors import ApiError
from router.fanout import fan_out, many_deltas
from router.http_streams import drain, sse_many, sse_message, sse_stream
from router.openai_api import Accumulator, Envelope, model_list
from router.response_objects import ResponseEvents, ResponseHead, new_id, whole_response
from router.response_store import StoredResponse
from router.responses import ResponseRequest, output_history, prepare_response
from router.stream_events import echoed, server_error
from router.tokenization import detokenize, tokenize
from router.validation import Choice, PreparedRequest, bearer, choices, prepare_chat, prepare_completions

log = logging.getLogger(__name__)

VERSION = importlib.metadata.version("tandem-serve")

GRPC_SERVICERS = [
    "router.grpc_api.add_generation_servicer",
    "router.grpc_api.add_health_servicer",
]


app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)


def _error_response(e: ApiError) -> Response:
    # ASCII JSON: a message that quotes the request (a model name, say) may hold a lone
    # surrogate from a \ud800 escape, which UTF-8 cannot encode.
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    body = json.dumps(e.body())
    return Response(body, status_code=e.status, headers=headers, media_type="application/json")


@app.exception_handler(ApiError)
async def _api_error(_: Request, e: ApiError) -> Response:
    return _error_response(e)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
    return _error_response(ApiError(e.status_code, str(e.detail)))


async def _read_body(request: Request, limit: int) -> bytes:
    """The body; 413 once it passes ``limit``, before reading the rest (chunked uploads too)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes, over the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # A body cut short is the client's doing: a 4xx, never a 500 (with HAProxy in
        # front, the client may still read the answer on its half-closed socket).
        raise ApiError(400, "the request body ended early: the client closed the connection") from None
    return b"".join(chunks)


def _validated(raw: bytes, core: RouterCore, validate):
    """``validate(body, model, tokenizer)`` of the JSON body ``raw``: on a tokenizer thread."""
    return validate(parse_json(raw, core.config.max_body_bytes), core.model, core.tokenizer)


def _chat_batch(body: dict, model, tokenizer) -> list[PreparedRequest]:
    return [prepare_chat(body, model, tokenizer)]


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response has the id {response_id!r} (it was never stored, was deleted, "
                    "or was pushed out of the store)", param="response_id", code="response_not_found")


# The router's code never blocks its event loop, so it runs on the replica's own loop:
# with user code in a separate thread (Serve's default) every streamed chunk hops
# between two loops, about 15% of the router's CPU per token (docs/BENCHMARKS.md).
SAME_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


# A replica that stops (scale-down, redeploy, shutdown) checks for requests still open
# every quarter second, not Serve's 2 s: an idle one is gone at once.
DRAIN_CHECK_S = 0.25


@serve.deployment(
    max_ongoing_requests=4096,
    graceful_shutdown_wait_loop_s=DRAIN_CHECK_S,
    ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": SAME_LOOP}},
)
@serve.ingress(app)
class Router:
    """The Serve deployment: each replica answers HTTP and gRPC through one ``RouterCore``,
    connected at start to the cluster controller it was bound to (``cluster.service``); Serve
    starts, scales and stops the replicas."""

    def __init__(self, controller, config: RouterConfig) -> None:
        self.core = RouterCore.connect(controller, config)

    # -- HTTP ------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> JSONResponse:
        ok = self.core.healthy
        return JSONResponse({"status": "ok" if ok else "no decode workers"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self.core.check_key(bearer(request.headers.get("authorization")))
        model = self.core.model
        return model_list(model.name, self.core.created, model.max_model_len, model.adapters)

    @app.get("/status")
    async def status(self, request: Request) -> dict:
        """The pools as the cluster controller sees them (``tandem status`` prints it)."""
        self.core.check_key(bearer(request.headers.get("authorization")))
        return await self.core.controller.status.remote()

    @app.get("/version")
    async def version(self, request: Request) -> dict:
        self.core.check_key(bearer(request.headers.get("authorization")))
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> dict:
        return await self._tokenizer_call(request, tokenize)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> dict:
        return await self._tokenizer_call(request, detokenize)

    async def _tokenizer_call(self, request: Request, handle) -> dict:
        raw = await self._body(request)
        return await self.core.prepare(len(raw), partial(_validated, raw, self.core, handle))

    async def _body(self, request: Request) -> bytes:
        """The body of a request with the API key (else 401); 413 past ``max_body_bytes``,
        400 cut short (both counted as invalid requests)."""
        core = self.core
        core.check_key(bearer(request.headers.get("authorization")))
        try:
            return await _read_body(request, core.config.max_body_bytes)
        except ApiError:
            core.metrics.on_rejected("invalid_request")
            raise

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http(request, chat=True)

    async def _http(self, request: Request, chat: bool):
        core = self.core
        raw = await self._body(request)
        validate = _chat_batch if chat else prepare_completions
        batch = await core.prepare(len(raw), partial(_validated, raw, core, validate))
        for prepared in batch:
            await core.check_structured_output(prepared)
        if len(batch) > 1 or batch[0].n > 1:
            return await self._http_many(batch, chat)
        prepared = batch[0]
        ticket = core.admit(prepared)
        env = Envelope(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", core.model.name, int(time.time()))
        deltas, first = await self._started(prepared, env.id, ticket)
        acc = Accumulator(core.tokenizer)
        first = echoed(first, prepared)
        if not prepared.stream:
            await drain(first, deltas, acc)
            return env.chat(acc, prepared.tools, prepared.reasoning) if chat else env.completion(acc)
        if prepared.tools is not None or prepared.reasoning is not None:
            body = sse_message(first, deltas, acc, env, prepared)
        else:
            body = sse_stream(first, deltas, acc, env, prepared, chat)
        return StreamingResponse(body, media_type="text/event-stream")

    async def _started(self, prepared: PreparedRequest, rid: str, ticket: Ticket):
        """The request's deltas, run, and its first one; a first delta that failed is
        the HTTP error it says."""
        deltas = self.core.run(prepared, rid, ticket)
        try:
            first = await anext(deltas)
        except BaseException:
            await deltas.aclose()
            raise
        if first.error:
            await deltas.aclose()
            raise server_error(first)
        return deltas, first

    async def _http_many(self, batch: list[PreparedRequest], chat: bool):
        """A request of several choices (prompts × n): a request each, its choice at its
        place; admitted all together or not at all."""
        core, n = self.core, batch[0].n
        every = choices(batch)
        tickets = core.admit_all(every, n)
        env = Envelope(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", core.model.name, int(time.time()))
        fan = fan_out(core, every, tickets, env.id)
        accs = [Accumulator(core.tokenizer) for _ in every]
        if not batch[0].stream:
            try:
                async with aclosing(many_deltas(fan, accs, every)) as deltas:
                    async for _, delta, _ in deltas:
                        if delta.error:
                            raise server_error(delta)
            finally:
                await fan.close()
            return env.choices(accs, chat, n, batch[0].reasoning)
        body = sse_many(fan, accs, env, every, chat, n)
        return StreamingResponse(body, media_type="text/event-stream")

    # -- the Responses API ---------------------------------------------------------

    @app.post("/v1/responses")
    async def create_response(self, request: Request):
        """A response (``router.responses``), run as a chat completion: whole, or as typed
        events with ``stream``; stored (``store``, the default) once it finished."""
        core = self.core
        raw = await self._body(request)
        req = await core.prepare(len(raw), partial(_validated, raw, core, partial(prepare_response, core.responses)))
        prepared = req.prepared
        await core.check_structured_output(prepared)
        ticket = core.admit(prepared)
        head = ResponseHead(new_id("resp"), int(time.time()), core.model.name, req.fields)
        deltas, first = await self._started(prepared, head.id, ticket)
        acc = Accumulator(core.tokenizer)
        if prepared.stream:
            return StreamingResponse(self._sse_response(first, deltas, acc, req, head), media_type="text/event-stream")
        await drain(first, deltas, acc)
        message = read_message(acc.text, acc.finish_reason, prepared.tools, prepared.reasoning)
        response = whole_response(head, message, acc, self._count_tokens)
        self._store(req, response)
        return response

    async def _sse_response(self, first, deltas, acc: Accumulator, req: ResponseRequest, head: ResponseHead):
        """A response's typed events (``ResponseEvents``): opened, each item as it grows,
        then the whole response (or the error and the failed response)."""
        events = ResponseEvents(head, MessageStream(req.prepared.reasoning, req.prepared.tools))
        yield events.opening()
        async with aclosing(deltas):
            delta = first
            while not delta.error:
                acc.add(delta)
                if out := events.feed(delta.text):
                    yield out
                if delta.finished:
                    break
                delta = await anext(deltas)
            else:
                yield events.failed(server_error(delta))
                return
        last, response = events.finish(acc.finish_reason, acc, self._count_tokens)
        self._store(req, response)
        yield last

    def _count_tokens(self, text: str) -> int:
        return len(self.core.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def _store(self, req: ResponseRequest, response: dict) -> None:
        if req.store:
            history = output_history(req, response["output"])
            self.core.responses.put(response["id"], StoredResponse(response, history))

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request) -> dict:
        """A stored response, as it was answered (404 when it is not stored)."""
        self.core.check_key(bearer(request.headers.get("authorization")))
        stored = self.core.responses.get(response_id)
        if stored is None:
            raise _not_stored(response_id)
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> dict:
        """Forget a stored response (404 when it is not stored)."""
        self.core.check_key(bearer(request.headers.get("authorization")))
        if not self.core.responses.delete(response_id):
            raise _not_stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # -- gRPC ------------------------------------------------------------------

    async def Generate(self, request, grpc_context):
        core = self.core
        try:
            prepared, rid = await self._grpc_prepare(request, grpc_context)
            if prepared.n > 1:
                every = choices([prepared])
                tickets = core.admit_all(every, prepared.n)
            else:
                ticket = core.admit(prepared)
        except ApiError as e:
            grpc_api.fail(grpc_context, grpc_api.status_code(e), e.message)
        if prepared.n > 1:
            async with aclosing(self._grpc_choices(every, tickets, rid, grpc_context)) as messages:
                async for message in messages:
                    yield message
            return
        async with aclosing(core.run(prepared, rid, ticket)) as deltas:
            async for delta in deltas:
                if delta.error:
                    grpc_api.fail(grpc_context, grpc_api.status_code(server_error(delta)), delta.error)
                yield grpc_api.response(delta, rid, prepared.prompt_token_ids)

    async def _grpc_prepare(self, request, grpc_context) -> tuple[PreparedRequest, str]:
        """The request validated (ApiError naming the field) and its id, after auth."""
        core = self.core
        core.check_key(grpc_api.api_key(grpc_context))
        grpc_api.well_formed(request, grpc_context)
        size, limit = request.ByteSize(), core.config.max_body_bytes
        if size > limit:  # under Serve's limit (grpc refuses larger ones) but over this app's
            core.metrics.on_rejected("invalid_request")
            raise ApiError(413, f"the request is {size} bytes, over the limit of {limit} bytes")
        prepared = await core.prepare(size, partial(grpc_api.prepare, request, core.model, core.tokenizer))
        await core.check_structured_output(prepared)
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        if core.in_flight(rid):
            raise ApiError(400, f"request_id {rid!r} is already in flight", param="request_id")
        return prepared, rid

    async def _grpc_choices(self, every: list[Choice], tickets: list[Ticket], rid: str, grpc_context):
        """The messages of a request of several choices, interleaved, each with its index.
        An Abort of ``rid`` stops them all, and each choice not finished ends with "abort"."""
        core, prompt = self.core, every[0].prepared.prompt_token_ids
        fan = core.fanouts[rid] = fan_out(core, every, tickets, rid)
        sent: list[int | None] = [0] * len(every)  # each choice's tokens so far; None once finished
        try:
            while (item := await fan.next()) is not None:
                i, delta = item
                if delta.error:
                    grpc_api.fail(grpc_context, grpc_api.status_code(server_error(delta)), delta.error)
                sent[i] = None if delta.finished else delta.num_output_tokens
                yield grpc_api.response(delta, rid, prompt, i)
            await fan.close()  # aborted: stop the choices (aborting them on the workers), then say so
            for i, tokens in enumerate(sent):
                if tokens is not None:
                    yield grpc_api.response(aborted_delta(rid, len(prompt), tokens), rid, prompt, i)
        finally:
            del core.fanouts[rid]
            await fan.close()

    async def Abort(self, request, grpc_context):
        self._grpc_auth(grpc_context)
        grpc_api.well_formed(request, grpc_context)
        try:
            found = self.core.abort(request.request_id)
        except ApiError as e:  # past the budget of Aborts passed to every worker
            grpc_api.fail(grpc_context, grpc_api.status_code(e), e.message)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request, grpc_context):
        self._grpc_auth(grpc_context)
        grpc_api.well_formed(request, grpc_context)
        return grpc_api.model_info(self.core.model)

    async def Check(self, request, grpc_context):
        grpc_api.well_formed(request, grpc_context)
        status = health_pb2.HealthCheckResponse.SERVING if self.core.healthy else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    def _grpc_auth(self, grpc_context) -> None:
        try:
            self.core.check_key(grpc_api.api_key(grpc_context))
        except ApiError as e:
            grpc_api.fail(grpc_context, grpc_api.status_code(e), e.message)
