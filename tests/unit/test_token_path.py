"""The router's streaming path in one process (``bench.token_path``): every stream gets
every token as one SSE event, in order, and ends with [DONE]."""

from __future__ import annotations

import asyncio
import json

from bench import token_path


def test_streams_through_the_real_handler_carry_every_token(tiny_model):
    async def run():
        worker = token_path.StepWorker(output_len=6, text="ab")
        router = token_path.make_router(str(tiny_model), worker)
        bodies = []

        async def one():
            chunks = []
            await token_path.stream_request(router, _body(6), chat=False, on_chunk=chunks.append)
            bodies.append(b"".join(chunks).decode())

        tasks = [asyncio.ensure_future(one()) for _ in range(3)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(token_path.STEP_S)
            worker.step()
        await asyncio.gather(*tasks)
        assert not worker.active and not router.core.dispatcher._inflight
        return bodies

    for body in asyncio.run(run()):
        events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "ab" * 6
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]


def _body(max_tokens: int) -> bytes:
    return json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True}).encode()
