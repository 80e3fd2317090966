"""The answers of the completions endpoints, out of a request's deltas: whole into an
``Accumulator`` (``drain``) or as the body of a server-sent event stream.

``router.server``'s handlers call these once a request is admitted and its first delta
came: a request of one choice streams through the lean path (``sse_stream``) unless its
message is read as it streams, because it may call tools or its thinking goes apart
from its answer (``sse_message``); a request of several choices streams their chunks
interleaved (``sse_many``, over a ``router.fanout.Fanout``). The events themselves are
made by ``router.stream_events`` and ``router.openai_api``.

Leaving a stream early (the client went away) closes its deltas, which aborts the
request on the workers.
"""

from __future__ import annotations

from contextlib import aclosing

from router.chat_output import MessageStream
from router.fanout import Fanout, many_deltas
from router.openai_api import Accumulator, Envelope, sse
from router.stream_events import choice_event, message_choice_event, opening_event, server_error, sse_event, tool_events
from router.validation import Choice, PreparedRequest


async def drain(first, deltas, acc: Accumulator) -> None:
    """Every delta of a request answered whole, into ``acc``."""
    acc.add(first)
    async with aclosing(deltas):
        async for delta in deltas:
            if delta.error:
                raise server_error(delta)
            acc.add(delta)


async def sse_stream(first, deltas, acc, env: Envelope, prepared: PreparedRequest, chat: bool):
    """The event stream of a completion, or of a chat completion (opened by the role).

    Leaving early (the client went away) closes ``deltas``, which aborts the request.
    """
    async with aclosing(deltas):
        opening, delta = opening_event(env, acc, first, chat)
        if opening is not None:
            yield opening
        while True:
            if delta.error:
                last = sse(server_error(delta).body())
                break
            last = sse_event(env, acc, delta, chat)
            if delta.finished:
                break
            yield last
            delta = await anext(deltas)
    if prepared.include_usage:
        last += sse(env.usage_chunk("chat.completion.chunk" if chat else "text_completion", acc))
    yield last + sse("[DONE]")  # the stream's last events in one write


async def sse_message(first, deltas, acc: Accumulator, env: Envelope, prepared: PreparedRequest):
    """The event stream of a chat completion whose message is read as it streams
    (``MessageStream``): its thinking as ``reasoning_content``, then content as it
    comes until a call begins, then the calls, then the finish reason.

    Apart from ``sse_stream`` so that other requests keep their lean path.
    """
    stream = MessageStream(prepared.reasoning, prepared.tools)
    async with aclosing(deltas):
        opening, delta = opening_event(env, acc, first, True)
        yield opening
        while not delta.error:
            for event in tool_events(env, acc, stream, delta):
                yield event
            if delta.finished:
                break
            delta = await anext(deltas)
        else:
            yield sse(server_error(delta).body())
    if prepared.include_usage:
        yield sse(env.usage_chunk("chat.completion.chunk", acc))
    yield sse("[DONE]")


async def sse_many(fan: Fanout, accs: list[Accumulator], env: Envelope, batch: list[Choice], chat: bool, n: int):
    """The event stream of several choices, their chunks interleaved (a chat stream
    opens each choice with its role; with its reasoning read, through a
    ``MessageStream`` a choice)."""
    reasoning = batch[0].prepared.reasoning
    streams = [MessageStream(reasoning, None) for _ in batch] if reasoning is not None else None
    try:
        if chat:
            for i in range(len(batch)):
                yield sse(env.chat_chunk({"role": "assistant", "content": ""}, None, None, index=i))
        async with aclosing(many_deltas(fan, accs, batch)) as deltas:
            async for i, delta, lps in deltas:
                if delta.error:
                    yield sse(server_error(delta).body())
                    break
                if streams is None:
                    yield choice_event(env, accs[i], i, delta, lps, chat)
                elif event := message_choice_event(env, accs[i], i, delta, lps, streams[i]):
                    yield event
        if batch[0].prepared.include_usage:
            yield sse(env.choices_usage_chunk(accs, chat, n))
        yield sse("[DONE]")
    finally:
        await fan.close()

