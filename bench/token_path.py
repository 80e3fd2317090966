"""The router's own CPU per streamed token, in one process: no Ray, no sockets.

A stand-in decode worker (``StepWorker``) answers the real ``Dispatcher`` the way a
decode worker does: one ``subscribe`` message per engine step with every request's
delta. The real ``Router`` handler turns the deltas into server-sent events through
Starlette's ``StreamingResponse``, into an ASGI ``send`` that drops the bytes. The
process's CPU time over the output tokens is the cost of the path the router owns:
the dispatcher's fan-out, the per-request generators, metrics, JSON and SSE framing.
What a live replica adds (Serve's ASGI wrappers, uvicorn, the socket write, Ray's
deserialisation) is ``bench.overhead``'s to measure; this one is quiet enough to
compare two versions of the router's code on a busy machine (take the best of the runs:
other processes only ever add to it).

    python -m bench.token_path [--requests 32] [--output-len 128] [--repeat 10] [--chat]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict

from bench.common import write_result

STEP_S = 0.002  # between two engine steps: enough for every stream to drain the last one


class _Call:
    """``handle.method.remote(...)`` on a local object: the call, as an awaitable."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args, **kwargs):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self._fn(*args, **kwargs))
        return fut

    def options(self, **_):
        return self


class StepWorker:
    """A decode worker's Ray surface, producing ``output_len`` tokens per request."""

    def __init__(self, output_len: int, text: str = " token") -> None:
        self.output_len = output_len
        self.text = text
        self.active: dict[str, list] = {}  # request id -> [subscriber, prompt length, tokens made]
        self.queues: dict[str, asyncio.Queue] = defaultdict(asyncio.Queue)
        self.load = _Call(self._load)
        self.submit = _Call(self._submit)
        self.abort = _Call(lambda rid: self.active.pop(rid, None))
        self.subscribe = _Subscribe(self.queues)
        self.token_channel = _Call(lambda: None)  # none: the stream comes over ``subscribe``

    def _load(self):
        from engine.wire.messages import DecodeLoad

        return DecodeLoad("decode[0]", running=len(self.active), waiting=0, waiting_for_kv=0,
                          free_blocks=1 << 20, total_blocks=1 << 20)

    def _submit(self, rid, prompt, params, *, subscriber, resume_output=(), priority=0) -> None:
        self.active[rid] = [subscriber, len(prompt), 0]

    def step(self) -> None:
        """One engine step: a token for every active request, one message per subscriber."""
        messages: dict[str, list] = defaultdict(list)
        for rid, state in list(self.active.items()):
            subscriber, prompt_len, made = state
            state[2] = made = made + 1
            finished = made == self.output_len
            messages[subscriber].append(
                (rid, [made], self.text, finished, "length" if finished else None, prompt_len, made, 0,
                 None, None, None, None)
            )
            if finished:
                del self.active[rid]
        for subscriber, items in messages.items():
            self.queues[subscriber].put_nowait((self._load(), items))


class _Subscribe:
    def __init__(self, queues) -> None:
        self.queues = queues

    def options(self, **_):
        return self

    def remote(self, subscriber: str):
        return self._stream(self.queues[subscriber])

    async def _stream(self, queue: asyncio.Queue):
        while True:
            items = await queue.get()
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(items)
            yield fut  # what a streaming generator yields: an awaitable per message


def make_router(model_dir: str, worker: StepWorker):
    """The Serve deployment's class, built around a core that talks to ``worker``."""
    from router.core import RouterConfig, RouterCore
    from router.dispatch import WorkerRef
    from router.server import Router

    info = {
        "name": "bench", "model_dir": model_dir, "max_model_len": 2048, "vocab_size": 256,
        "block_size": 16, "max_kv_blocks": 1 << 20, "prefill_workers": 0, "decode_workers": 1,
    }
    workers = ([], [WorkerRef("decode[0]", worker, "decode-0")])
    core = RouterCore(None, RouterConfig(), info, workers, {"block_size": 16, "max_running_per_decode": 4096})
    core._refresher = asyncio.get_running_loop().create_future()  # the worker list never changes here
    # The class Serve wraps (its ASGI wrapper's __del__ expects a running replica).
    cls = next(c for c in Router.func_or_class.__mro__ if "_http" in vars(c))
    router = cls.__new__(cls)
    router.core = core
    return router


async def stream_request(router, body: bytes, chat: bool, on_chunk=None) -> int:
    """One streaming request through the handler and its response; returns bytes sent.

    ``on_chunk(bytes)``, if given, sees every body chunk the response sends."""
    from starlette.requests import Request

    path = "/v1/chat/completions" if chat else "/v1/completions"
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 0)}
    received = asyncio.Event()
    sent = 0

    async def receive():
        if not received.is_set():
            received.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        nonlocal sent
        chunk = message.get("body", b"")
        sent += len(chunk)
        if on_chunk is not None and chunk:
            on_chunk(chunk)

    response = await router._http(Request(scope, receive), chat=chat)
    await response(scope, receive, send)
    return sent


async def run_once(router, worker: StepWorker, requests: int, prompt_len: int, chat: bool) -> tuple[float, int]:
    """CPU seconds and output tokens for ``requests`` streams started together."""
    if chat:
        payload = {"messages": [{"role": "user", "content": "hi " * prompt_len}]}
    else:
        payload = {"prompt": list(range(1, prompt_len + 1))}
    body = json.dumps({"model": "bench", "stream": True, "max_tokens": worker.output_len,
                       "ignore_eos": True, **payload}).encode()
    cpu = time.process_time()
    tasks = [asyncio.ensure_future(stream_request(router, body, chat)) for _ in range(requests)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(STEP_S)
        worker.step()
    await asyncio.gather(*tasks)
    return time.process_time() - cpu, requests * worker.output_len


async def main_async(args) -> dict:
    from engine.model.default_model import ensure_default_model

    worker = StepWorker(args.output_len)
    router = make_router(str(ensure_default_model()), worker)
    await run_once(router, worker, args.requests, args.input_len, args.chat)  # warm-up
    per_token = []
    for _ in range(args.repeat):
        cpu, tokens = await run_once(router, worker, args.requests, args.input_len, args.chat)
        per_token.append(cpu / tokens * 1e6)
    assert not worker.active, "every request ran to its end"
    return {"requests": args.requests, "output_len": args.output_len, "chat": args.chat,
            "cpu_us_per_token": per_token, "median_cpu_us_per_token": statistics.median(per_token),
            "min_cpu_us_per_token": min(per_token)}


def _run_on_rays_loop(coro):
    """Run on the event loop Ray gives a replica: uvloop where installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="streams in flight together")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--chat", action="store_true", help="chat completions instead of completions")
    ap.add_argument("--out", default="bench-results/token_path.json")
    args = ap.parse_args(argv)
    result = _run_on_rays_loop(main_async(args))
    runs = " ".join(f"{v:.1f}" for v in result["cpu_us_per_token"])
    print(f"router path CPU per streamed token: median {result['median_cpu_us_per_token']:.1f} us, "
          f"best {result['min_cpu_us_per_token']:.1f} us (runs: {runs})")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
