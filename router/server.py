"""The router: one Ray Serve deployment serving the OpenAI HTTP API and the gRPC API.

HTTP (FastAPI ingress): ``POST /v1/completions``, ``POST /v1/chat/completions`` (with
``stream`` as server-sent events), ``GET /v1/models``, ``GET /health``, and vLLM's
``POST /tokenize``, ``POST /detokenize`` and ``GET /version``. gRPC (Serve's
gRPC proxy, servicers from ``protos``): ``tandem.v1.Generation`` and
``grpc.health.v1.Health/Check``.

A request's way through a replica::

    auth ─▶ parse + validate + tokenize (4xx) ─▶ output constraint parsed (400; helper
      process) ─▶ admission (429 / RESOURCE_EXHAUSTED)
      ─▶ Dispatcher.generate ─▶ deltas out as JSON, SSE chunks or gRPC messages
      ─▶ admission ticket released (finished, failed, aborted or client gone)

A chat request that may call tools (``PreparedRequest.tools``) streams through a path
of its own (``_sse_tools``), so that every other stream keeps the lean one (``_sse``).

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


import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

# No ``from __future__ import annotations`` here: FastAPI must see real classes in the
# ingress methods' signatures (``Request``). Serve pickles the ingress class when it is
# decorated, so every helper it calls is defined above it.
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.messages import ErrorKind, StreamDelta
from engine.metrics import RouterMetrics
from protos.grpc.health.v1 import health_pb2
from protos.tandem.v1 import generate_pb2 as pb
from router import grpc_api
from router.admission import Admission, AdmissionConfig, Rejection, Ticket
from router.dispatch import Affinity, DispatchConfig, Dispatcher, aborted_delta
from router.grammar_check import GrammarChecker
from router.latency import LatencyWindow
from router.openai_api import Accumulator, Envelope, echo_logprobs, model_list, prompt_logprobs_json, sse
from router.tokenization import detokenize, tokenize
from router.tool_calls import ToolStream
from router.validation import (
    ApiError,
    Choice,
    PreparedRequest,
    ServedModel,
    check_api_key,
    choices,
    parse_json,
    prepare_chat,
    prepare_completions,
)

log = logging.getLogger(__name__)

VERSION = importlib.metadata.version("tandem-serve")

GRPC_SERVICERS = [
    "router.grpc_api.add_generation_servicer",
    "router.grpc_api.add_health_servicer",
]


@dataclass(frozen=True)
class RouterConfig:
    """A router replica's settings: admission bounds, dispatch settings (the cluster supplies block
    size and running cap), body size limit, API key and how often the worker list is refreshed;
    ``cluster.service`` builds it from the flags or a RayService's args."""

    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)  # block size etc. come from the cluster
    max_body_bytes: int = 1 << 20
    api_key: str | None = None  # None: no auth
    workers_refresh_s: float = 1.0  # also how often the replica reports its latency to the controller
    latency_window_s: float = 10.0  # the span of the TTFT / ITL percentiles it reports


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


class RouterCore:
    """The transport-independent part: validation, admission, dispatch, auth."""

    def __init__(self, controller, config: RouterConfig, info: dict, workers: tuple, dispatch_settings: dict) -> None:
        """``info``, ``workers`` and ``dispatch_settings``: the cluster controller's
        ``model_info()``, ``workers()`` and ``dispatch_settings()`` (see ``connect``)."""
        from engine.tokenizer import Tokenizer

        self.controller = controller
        self.config = config
        info = dict(info)
        self.tokenizer = Tokenizer.from_pretrained(info.pop("model_dir"))
        self.model = ServedModel(**info)
        self.created = int(time.time())
        self.admission = Admission(config.admission)
        self.replica_id = f"router-{os.getpid()}"
        self.metrics = RouterMetrics(self.model.name, self.replica_id)
        self.latency = LatencyWindow(config.latency_window_s)  # reported for the pools' control loop
        self._prefill, self._decode = workers
        self._refresher: asyncio.Task | None = None
        # Block size and running cap must match the workers' engines, and the prefix hash
        # follows the deployment's setting: the controller knows them.
        dispatch = dataclasses.replace(config.dispatch, **dispatch_settings)
        self.dispatcher = Dispatcher(lambda: self._prefill, lambda: self._decode, dispatch, self.metrics)
        self.grammars = GrammarChecker()
        self.fanouts: dict[str, Fanout] = {}  # request id -> its choices, for a request of several in flight

    @classmethod
    def connect(cls, controller, config: RouterConfig) -> "RouterCore":
        """A core for the cluster behind ``controller`` (a cluster controller actor handle).

        Asks for the controller's ``start``, which is idempotent: it answers once the
        pools are up, so a replica may be created while they still start.
        """
        info = ray.get(controller.start.remote())
        workers, settings = ray.get([controller.workers.remote(), controller.dispatch_settings.remote()])
        return cls(controller, config, info, workers, settings)

    # -- workers ---------------------------------------------------------------

    def ensure_refreshing(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        """Every ``workers_refresh_s``: the live worker list from the controller, and this
        replica's recent latency to it (the pools' control loop reads it against the SLO)."""
        while True:
            await asyncio.sleep(self.config.workers_refresh_s)
            try:
                self._prefill, self._decode = await self.controller.workers.remote()
                self.controller.report_latency.remote(self.replica_id, self.latency.report(time.monotonic()))
            except Exception:  # the controller restarting is no reason to stop serving
                log.exception("could not refresh the worker list")

    @property
    def healthy(self) -> bool:
        return bool(self._decode)

    # -- auth and admission ----------------------------------------------------

    def check_key(self, presented: str | None) -> None:
        check_api_key(self.config.api_key, presented)

    async def check_structured_output(self, prepared: PreparedRequest) -> None:
        """400 naming the field when xgrammar cannot parse the request's output constraint."""
        so = prepared.params.structured_output
        if so is None:
            return
        error = await self.grammars.check(so, prepared.structured_field)
        if error is not None:
            raise ApiError(400, error, param=prepared.structured_field)

    def admit_all(self, batch: list[Choice], n: int) -> list[Ticket]:
        """A ticket for each choice of ``batch`` (``n`` a prompt), or none (429); 400 for
        a batch larger than admission ever takes at once (it would be refused forever)."""
        lengths = [len(c.prepared.prompt_token_ids) for c in batch]
        try:
            decision = self.admission.try_admit_all(lengths, time.monotonic())
        except ValueError as e:
            prompts = len(batch) // n
            raise ApiError(400, f"{prompts} prompts with n = {n} are {len(batch)} choices: {e}",
                           param="n" if n > 1 else "prompt") from None
        return self._admitted(decision)

    def admit(self, prepared: PreparedRequest) -> Ticket:
        return self._admitted(self.admission.try_admit(len(prepared.prompt_token_ids), time.monotonic()))

    def _admitted(self, decision):
        """The ticket(s) of an admission decision; a rejection is a 429."""
        if isinstance(decision, Rejection):
            self.metrics.on_rejected(decision.code)
            raise ApiError(429, f"server busy: {decision.reason}; retry after {decision.retry_after_s}s",
                           type="rate_limit_error", code="server_busy", retry_after_s=decision.retry_after_s)
        return decision

    def release(self, ticket: Ticket) -> None:
        self.admission.release(ticket, time.monotonic())

    # -- requests by id (gRPC) -------------------------------------------------

    def in_flight(self, rid: str) -> bool:
        return rid in self.fanouts or self.dispatcher.in_flight(rid)

    def abort(self, rid: str) -> bool:
        """Abort request ``rid`` (each of its choices, when it has several); returns
        whether it was in flight here."""
        fan = self.fanouts.get(rid)
        if fan is None:
            return self.dispatcher.abort(rid)
        fan.abort()
        return True

    async def run(
        self, prepared: PreparedRequest, rid: str, ticket: Ticket,
        after: asyncio.Event | None = None, affinity: Affinity | None = None,
    ) -> AsyncIterator:
        """The request's deltas; releases the admission ticket however it ends.

        ``after``: start once it is set (its prompt's first choice has prefilled the
        prompt); ``affinity``: the placement it shares with its prompt's other choices.
        """
        self.ensure_refreshing()
        start = last = time.monotonic()
        ttft = None
        output_tokens = 0
        reason = "abort"  # if the client leaves before the end
        try:
            if after is not None:
                await after.wait()
                start = last = time.monotonic()
            deltas = self.dispatcher.generate(
                prepared.prompt_token_ids, prepared.params, rid, affinity, priority=prepared.priority
            )
            async for delta in deltas:
                now = time.monotonic()
                if delta.token_ids:
                    if ttft is None:
                        ttft = now - start
                        self.metrics.on_first_token(ttft)
                        self.latency.first_token(ttft, now)
                    else:
                        self.metrics.on_tokens(len(delta.token_ids), now - last)
                        self.latency.tokens(len(delta.token_ids), now - last, now)
                    last = now
                    output_tokens += len(delta.token_ids)
                if delta.finished:
                    reason = delta.finish_reason or "error"
                yield delta
        finally:
            self.release(ticket)
            self.metrics.on_finished(
                reason, time.monotonic() - start, ttft, len(prepared.prompt_token_ids), output_tokens
            )


def _server_error(delta: StreamDelta) -> ApiError:
    """A failed request: 503 (retry later) when the workers had no room, 400 for a bad
    request the workers caught, else 500."""
    if delta.error_kind == ErrorKind.NO_CAPACITY:
        return ApiError(503, delta.error, type="server_error", code="no_capacity", retry_after_s=1)
    if delta.error_kind == ErrorKind.INVALID:
        return ApiError(400, delta.error)
    return ApiError(500, delta.error, type="server_error")


def _sse_event(env: Envelope, acc: Accumulator, delta: StreamDelta, chat: bool) -> str:
    """One delta as a chunk event, folded into ``acc`` on the way."""
    offset = acc.text_len
    lps = acc.add(delta)
    reason = delta.finish_reason if delta.finished else None
    if chat:
        return env.chat_sse(delta.text, reason, lps)
    return env.completion_sse(delta.text, reason, lps, offset)


def _tool_events(env: Envelope, acc: Accumulator, stream: ToolStream, delta: StreamDelta) -> list[str]:
    """One delta of a request that may call tools as chunk events (``ToolStream`` decides
    what goes out when), folded into ``acc`` on the way; the last one ends with the
    finish reason."""
    lps = acc.add(delta)
    pieces = stream.feed(delta.text)
    if lps is not None and not pieces:
        pieces = [{}]  # the logprobs go out even while a call is held back
    events = [sse(env.chat_chunk(piece, lps if i == 0 else None, None)) for i, piece in enumerate(pieces)]
    if delta.finished:
        rest, parsed = stream.finish()
        events += [sse(env.chat_chunk(piece, None, None)) for piece in rest]
        reason = stream.plan.finish_reason(parsed, delta.finish_reason)
        events.append(sse(env.chat_chunk({}, None, reason)))
    return events


def _echoed(delta: StreamDelta, prepared: PreparedRequest) -> StreamDelta:
    """A request's first delta, with its prompt's text before it when it asked for echo
    (and its prompt's tokens and logprobs before the output's, with logprobs too)."""
    if prepared.echo is None:
        return delta
    delta = delta._replace(text=prepared.echo + delta.text)
    if prepared.echo_logprobs and delta.prompt_logprobs is not None:
        prompt = echo_logprobs(prepared.prompt_token_ids, delta.prompt_logprobs)
        delta = delta._replace(logprobs=prompt + (delta.logprobs or []))
    return delta


def _opening(
    env: Envelope, acc: Accumulator, first: StreamDelta, chat: bool
) -> tuple[str | None, StreamDelta]:
    """A stream's opening event (a chat's role chunk, or the prompt's logprobs: once per
    request, before its first delta), and the first delta without what it already sent."""
    prompt_lps = None
    if first.prompt_logprobs is not None:
        prompt_lps = prompt_logprobs_json(first.prompt_logprobs, acc.token_text)
        first = first._replace(prompt_logprobs=None)
    chunk = env.first_chunk(prompt_lps, chat)
    return None if chunk is None else sse(chunk), first


class Fanout:
    """The deltas of several runs as they come, each with its run's place.

    The runs start at once, each in a task of its own, so every one releases its
    admission ticket however it ends; ``close`` stops those still going (which aborts
    their requests). A run that raises raises from ``next``. ``firsts`` (one event a
    run, optional): set when the run's first delta came, or when it ended without one.
    ``abort`` ends the fan-out at once: ``next`` returns None from then on.
    """

    def __init__(self, runs: list[AsyncIterator], firsts: list[asyncio.Event] | None = None) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._left = len(runs)
        firsts = firsts or [asyncio.Event() for _ in runs]
        self._closing: asyncio.Future | None = None
        self.aborted = False
        self._tasks = [asyncio.ensure_future(self._pump(i, run, firsts[i])) for i, run in enumerate(runs)]

    async def _pump(self, i: int, run, first: asyncio.Event) -> None:
        try:
            async with aclosing(run):
                async for delta in run:
                    first.set()
                    self._queue.put_nowait((i, delta))
        except Exception as e:  # a worker's failure comes as a delta; this is a bug, not a disconnect
            self._queue.put_nowait((i, e))
        else:
            self._queue.put_nowait((i, None))  # the run is over
        finally:
            first.set()  # a run waiting on this one goes on without the cache

    async def next(self) -> tuple[int, StreamDelta] | None:
        """The next (place, delta); None once every run is over, or once aborted."""
        while self._left and not self.aborted:
            i, delta = await self._queue.get()
            if isinstance(delta, Exception):
                raise delta
            if delta is not None:
                return i, delta
            self._left -= 1  # run i is over (or, aborted, all are)
        return None

    def abort(self) -> None:
        """End the fan-out: ``next`` returns None, however many runs are still going
        (``close`` stops them)."""
        self.aborted = True
        self._queue.put_nowait((None, None))  # wakes a ``next`` that waits

    async def close(self) -> None:
        """Stop the runs still going and wait for them. Shielded: a client gone cancels
        the response, and under Starlette (anyio) every later await of it is cancelled
        too, so the stopping goes on in a task of its own."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._closing)

    async def _stop(self) -> None:
        await asyncio.sleep(0)  # a task cancelled before its first step would never start its run
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _fan_out(core: RouterCore, batch: list[Choice], tickets: list[Ticket], rid: str) -> Fanout:
    """The choices of one response run side by side: each prompt's first choice at once,
    the others once it streams (its prompt's blocks are then cached), placed with it."""
    firsts = [asyncio.Event() for _ in batch]
    affinities = {c.leader: Affinity() for c in batch}
    runs = [
        core.run(c.prepared, f"{rid}-{j}", ticket, None if c.leader == j else firsts[c.leader], affinities[c.leader])
        for j, (c, ticket) in enumerate(zip(batch, tickets))
    ]
    return Fanout(runs, firsts)


async def _many_deltas(fan: Fanout, accs: list[Accumulator], batch: list[Choice]):
    """(place, delta, its logprobs) as they come, each folded into its accumulator (after
    the echo of its prompt, on its first delta)."""
    started = [False] * len(batch)
    while (item := await fan.next()) is not None:
        i, delta = item
        if not started[i]:
            started[i], delta = True, _echoed(delta, batch[i].prepared)
        yield i, delta, None if delta.error else accs[i].add(delta)


def _choice_event(env: Envelope, acc: Accumulator, i: int, delta: StreamDelta, lps, chat: bool) -> str:
    """Choice ``i``'s delta (already in ``acc``) as a chunk event (the first one with the
    prompt's logprobs, when the request asked for them)."""
    reason = delta.finish_reason if delta.finished else None
    if chat:
        chunk = env.chat_chunk({"content": delta.text} if delta.text else {}, lps, reason, index=i)
    else:
        chunk = env.completion_chunk(delta.text, lps, acc.text_len - len(delta.text), reason, index=i)
    if delta.prompt_logprobs is not None:  # the choice's first delta: its prompt's logprobs, once
        (chunk if chat else chunk["choices"][0])["prompt_logprobs"] = acc.prompt_logprobs
    return sse(chunk)


def _bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return header


class GrpcStatusError(Exception):
    """Raised after the status code is set: Serve sends the code and details."""


def _fail(grpc_context, code, details: str):
    # Serve drops trailing metadata on errors, so hints (retry after) go in the details.
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    raise GrpcStatusError(details)


def _well_formed(request, grpc_context):
    """INVALID_ARGUMENT for bytes that did not parse as the method's message."""
    if isinstance(request, grpc_api.MalformedRequest):
        _fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, request.details)
    return request


def _grpc_key(grpc_context) -> str | None:
    metadata = dict(grpc_context.invocation_metadata())
    return _bearer(metadata.get("authorization")) or metadata.get("x-api-key")


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
        self.core.check_key(_bearer(request.headers.get("authorization")))
        return model_list(self.core.model.name, self.core.created, self.core.model.max_model_len)

    @app.get("/status")
    async def status(self, request: Request) -> dict:
        """The pools as the cluster controller sees them (``tandem status`` prints it)."""
        self.core.check_key(_bearer(request.headers.get("authorization")))
        return await self.core.controller.status.remote()

    @app.get("/version")
    async def version(self, request: Request) -> dict:
        self.core.check_key(_bearer(request.headers.get("authorization")))
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> dict:
        return await self._tokenizer_call(request, tokenize)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> dict:
        return await self._tokenizer_call(request, detokenize)

    async def _tokenizer_call(self, request: Request, handle) -> dict:
        core = self.core
        core.check_key(_bearer(request.headers.get("authorization")))
        limit = core.config.max_body_bytes
        try:
            return handle(parse_json(await _read_body(request, limit), limit), core.model, core.tokenizer)
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
        core.check_key(_bearer(request.headers.get("authorization")))
        limit = core.config.max_body_bytes
        try:
            body = parse_json(await _read_body(request, limit), limit)
            batch = [prepare_chat(body, core.model, core.tokenizer)] if chat else \
                prepare_completions(body, core.model, core.tokenizer)
            for prepared in batch:
                await core.check_structured_output(prepared)
        except ApiError:
            core.metrics.on_rejected("invalid_request")
            raise
        if len(batch) > 1 or batch[0].n > 1:
            return await self._http_many(batch, chat)
        prepared = batch[0]
        ticket = core.admit(prepared)
        env = Envelope(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", core.model.name, int(time.time()))
        deltas = core.run(prepared, env.id, ticket)
        acc = Accumulator(core.tokenizer)
        try:
            first = await anext(deltas)
        except BaseException:
            await deltas.aclose()
            raise
        if first.error:
            await deltas.aclose()
            raise _server_error(first)
        first = _echoed(first, prepared)
        if not prepared.stream:
            return await self._whole(first, deltas, acc, env, prepared, chat)
        if prepared.tools is not None:
            body = self._sse_tools(first, deltas, acc, env, prepared)
        else:
            body = self._sse(first, deltas, acc, env, prepared, chat)
        return StreamingResponse(body, media_type="text/event-stream")

    async def _whole(self, first, deltas, acc: Accumulator, env: Envelope, prepared: PreparedRequest, chat: bool):
        acc.add(first)
        async with aclosing(deltas):
            async for delta in deltas:
                if delta.error:
                    raise _server_error(delta)
                acc.add(delta)
        return env.chat(acc, prepared.tools) if chat else env.completion(acc)

    async def _sse(self, first, deltas, acc, env: Envelope, prepared: PreparedRequest, chat: bool):
        """The event stream of a completion, or of a chat completion (opened by the role).

        Leaving early (the client went away) closes ``deltas``, which aborts the request.
        """
        async with aclosing(deltas):
            opening, delta = _opening(env, acc, first, chat)
            if opening is not None:
                yield opening
            while True:
                if delta.error:
                    last = sse(_server_error(delta).body())
                    break
                last = _sse_event(env, acc, delta, chat)
                if delta.finished:
                    break
                yield last
                delta = await anext(deltas)
        if prepared.include_usage:
            last += sse(env.usage_chunk("chat.completion.chunk" if chat else "text_completion", acc))
        yield last + sse("[DONE]")  # the stream's last events in one write

    async def _sse_tools(self, first, deltas, acc: Accumulator, env: Envelope, prepared: PreparedRequest):
        """The event stream of a chat completion that may call tools: content as it comes
        until a call begins, then the calls (``ToolStream``), then the finish reason.

        Apart from ``_sse`` so that requests without tools keep their lean path.
        """
        stream = ToolStream(prepared.tools)
        async with aclosing(deltas):
            opening, delta = _opening(env, acc, first, True)
            yield opening
            while not delta.error:
                for event in _tool_events(env, acc, stream, delta):
                    yield event
                if delta.finished:
                    break
                delta = await anext(deltas)
            else:
                yield sse(_server_error(delta).body())
        if prepared.include_usage:
            yield sse(env.usage_chunk("chat.completion.chunk", acc))
        yield sse("[DONE]")

    async def _http_many(self, batch: list[PreparedRequest], chat: bool):
        """A request of several choices (prompts × n): a request each, its choice at its
        place; admitted all together or not at all."""
        core, n = self.core, batch[0].n
        every = choices(batch)
        tickets = core.admit_all(every, n)
        env = Envelope(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", core.model.name, int(time.time()))
        fan = _fan_out(core, every, tickets, env.id)
        accs = [Accumulator(core.tokenizer) for _ in every]
        if not batch[0].stream:
            try:
                async with aclosing(_many_deltas(fan, accs, every)) as deltas:
                    async for _, delta, _ in deltas:
                        if delta.error:
                            raise _server_error(delta)
            finally:
                await fan.close()
            return env.choices(accs, chat, n)
        body = self._sse_many(fan, accs, env, every, chat, n)
        return StreamingResponse(body, media_type="text/event-stream")

    async def _sse_many(self, fan: Fanout, accs: list[Accumulator], env: Envelope, batch: list[Choice],
                        chat: bool, n: int):
        """The event stream of several choices, their chunks interleaved (a chat stream
        opens each choice with its role)."""
        try:
            if chat:
                for i in range(len(batch)):
                    yield sse(env.chat_chunk({"role": "assistant", "content": ""}, None, None, index=i))
            async with aclosing(_many_deltas(fan, accs, batch)) as deltas:
                async for i, delta, lps in deltas:
                    if delta.error:
                        yield sse(_server_error(delta).body())
                        break
                    yield _choice_event(env, accs[i], i, delta, lps, chat)
            if batch[0].prepared.include_usage:
                yield sse(env.choices_usage_chunk(accs, chat, n))
            yield sse("[DONE]")
        finally:
            await fan.close()

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
            _fail(grpc_context, grpc_api.status_code(e), e.message)
        if prepared.n > 1:
            async with aclosing(self._grpc_choices(every, tickets, rid, grpc_context)) as messages:
                async for message in messages:
                    yield message
            return
        async with aclosing(core.run(prepared, rid, ticket)) as deltas:
            async for delta in deltas:
                if delta.error:
                    _fail(grpc_context, grpc_api.status_code(_server_error(delta)), delta.error)
                yield grpc_api.response(delta, rid, prepared.prompt_token_ids)

    async def _grpc_prepare(self, request, grpc_context) -> tuple[PreparedRequest, str]:
        """The request validated (ApiError naming the field) and its id, after auth."""
        core = self.core
        core.check_key(_grpc_key(grpc_context))
        _well_formed(request, grpc_context)
        try:
            size, limit = request.ByteSize(), core.config.max_body_bytes
            if size > limit:  # Serve's proxy takes messages up to 2 GiB; don't tokenize them
                raise ApiError(413, f"the request is {size} bytes, over the limit of {limit} bytes")
            prepared = grpc_api.prepare(request, core.model, core.tokenizer)
            await core.check_structured_output(prepared)
        except ApiError:
            core.metrics.on_rejected("invalid_request")
            raise
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        if core.in_flight(rid):
            raise ApiError(400, f"request_id {rid!r} is already in flight", param="request_id")
        return prepared, rid

    async def _grpc_choices(self, every: list[Choice], tickets: list[Ticket], rid: str, grpc_context):
        """The messages of a request of several choices, interleaved, each with its index.
        An Abort of ``rid`` stops them all, and each choice not finished ends with "abort"."""
        core, prompt = self.core, every[0].prepared.prompt_token_ids
        fan = core.fanouts[rid] = _fan_out(core, every, tickets, rid)
        sent: list[int | None] = [0] * len(every)  # each choice's tokens so far; None once finished
        try:
            while (item := await fan.next()) is not None:
                i, delta = item
                if delta.error:
                    _fail(grpc_context, grpc_api.status_code(_server_error(delta)), delta.error)
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
        _well_formed(request, grpc_context)
        return pb.AbortResponse(found=self.core.abort(request.request_id))

    async def GetModelInfo(self, request, grpc_context):
        self._grpc_auth(grpc_context)
        _well_formed(request, grpc_context)
        return grpc_api.model_info(self.core.model)

    async def Check(self, request, grpc_context):
        _well_formed(request, grpc_context)
        status = health_pb2.HealthCheckResponse.SERVING if self.core.healthy else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    def _grpc_auth(self, grpc_context) -> None:
        try:
            self.core.check_key(_grpc_key(grpc_context))
        except ApiError as e:
            _fail(grpc_context, grpc_api.status_code(e), e.message)
