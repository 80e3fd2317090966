"""The serving benchmark's clients: each sends one benchmark request and times its stream,
over streaming HTTP (``HttpClient``: ``/v1/completions`` with SSE) or gRPC (``GrpcClient``:
``tandem.v1.Generation/Generate``), filling in the request's ``RequestResult``.

``bench/serve.py`` is the program: it opens one client for the whole benchmark
(``open_client``) and runs the load through it; its docstring says how each latency is
taken from the chunks' times recorded here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Protocol

from load.results import RequestResult
from load.workloads import BenchRequest


class Client(Protocol):
    """Sends benchmark requests to the service and times their streams:
    ``HttpClient`` or ``GrpcClient``."""

    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        """Run ``request`` to the end of its stream, filling in ``result``."""


class HttpClient:
    """Streaming ``/v1/completions`` (SSE, usage in the last chunk) over httpx."""

    def __init__(self, http, base_url: str, api_key: str | None, model: str | None) -> None:
        self.http = http
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model

    def body(self, request: BenchRequest) -> dict:
        body = {
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        return body

    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        import httpx

        chunks: list[float] = []
        start = time.perf_counter()
        try:
            async with self.http.stream("POST", self.url, json=self.body(request), headers=self.headers) as r:
                if r.status_code == 200:
                    await self._read_events(r, chunks, result)
                else:
                    result.fail(f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
        except httpx.TimeoutException as e:
            result.fail("timeout", str(e))
        except httpx.HTTPError as e:
            result.fail("connection", f"{type(e).__name__}: {e}")
        result.record_stream(start, chunks, time.perf_counter())

    @staticmethod
    async def _read_events(response, chunks: list[float], result: RequestResult) -> None:
        finish_reason = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                _finish(result, finish_reason)
                return
            try:
                event = json.loads(data)
            except ValueError:
                result.fail("bad_event", data)
                return
            if "error" in event:
                result.fail("stream_error", str(event["error"].get("message", event["error"])))
                return
            if event.get("choices"):
                chunks.append(time.perf_counter())
                finish_reason = event["choices"][0].get("finish_reason") or finish_reason
            if event.get("usage"):
                usage = event["usage"]
                result.output_tokens = usage["completion_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        result.fail("incomplete_stream", "the stream ended without [DONE]")


class GrpcClient:
    """Server-streaming ``tandem.v1.Generation/Generate`` over grpc.aio."""

    def __init__(self, channel, api_key: str | None, timeout_s: float) -> None:
        from protos.tandem.v1 import generate_pb2_grpc

        self.stub = generate_pb2_grpc.GenerationStub(channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.timeout_s = timeout_s

    @staticmethod
    def message(request: BenchRequest):
        from protos.tandem.v1 import generate_pb2 as pb

        return pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=request.prompt_token_ids),
            sampling=pb.SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True),
        )

    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        import grpc

        chunks: list[float] = []
        start = time.perf_counter()
        last = None
        try:
            call = self.stub.Generate(self.message(request), metadata=self.metadata, timeout=self.timeout_s)
            async for msg in call:
                if msg.token_ids:
                    chunks.append(time.perf_counter())
                last = msg
        except grpc.aio.AioRpcError as e:
            result.fail(e.code().name.lower(), e.details() or "")
        else:
            if last is None or not last.finished:
                result.fail("incomplete_stream", "the stream ended before a finished message")
            else:
                result.output_tokens = last.usage.completion_tokens
                result.cached_tokens = last.usage.cached_tokens
                _finish(result, last.finish_reason)
        result.record_stream(start, chunks, time.perf_counter())


def _finish(result: RequestResult, finish_reason: str | None) -> None:
    """A stream that ended normally: completed unless the server aborted or failed it."""
    if finish_reason in ("abort", "error"):
        result.fail(finish_reason, f"finish_reason {finish_reason!r}")
    elif result.output_tokens == 0:
        result.fail("no_tokens", "the stream carried no tokens")
    else:
        result.ok = True


@contextlib.asynccontextmanager
async def open_client(args: argparse.Namespace, base_url: str, grpc_target: str):
    """The client for ``args.backend``; one connection pool for the whole benchmark."""
    if args.backend == "grpc":
        import grpc

        async with grpc.aio.insecure_channel(grpc_target) as channel:
            yield GrpcClient(channel, args.api_key, args.timeout)
        return
    import httpx

    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        yield HttpClient(http, base_url, args.api_key, args.served_model_name)
