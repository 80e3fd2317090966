"""A stream's deltas as OpenAI's server-sent events and errors: the opening chunk, each
delta's chunk (a tool request's through its ``ToolStream``), a choice's among several,
the echoed prompt, and a failed delta's HTTP error."""

from __future__ import annotations

from engine.wire.messages import ErrorKind, StreamDelta
from router.chat_output import MessageStream
from router.errors import ApiError
from router.openai_api import Accumulator, Envelope, echo_logprobs, prompt_logprobs_json, sse
from router.tool_calls import ToolStream
from router.validation import PreparedRequest


def server_error(delta: StreamDelta) -> ApiError:
    """A failed request: 503 (retry later) when the workers had no room, 400 for a bad
    request the workers caught, else 500."""
    if delta.error_kind == ErrorKind.NO_CAPACITY:
        return ApiError(503, delta.error, type="server_error", code="no_capacity", retry_after_s=1)
    if delta.error_kind == ErrorKind.INVALID:
        return ApiError(400, delta.error)
    return ApiError(500, delta.error, type="server_error")


def sse_event(env: Envelope, acc: Accumulator, delta: StreamDelta, chat: bool) -> str:
    """One delta as a chunk event, folded into ``acc`` on the way."""
    offset = acc.text_len
    lps = acc.add(delta)
    reason = delta.finish_reason if delta.finished else None
    if chat:
        return env.chat_sse(delta.text, reason, lps)
    return env.completion_sse(delta.text, reason, lps, offset)


def tool_events(env: Envelope, acc: Accumulator, stream: ToolStream | MessageStream, delta: StreamDelta) -> list[str]:
    """One delta of a request whose message is read as it streams (it may call tools, or
    its reasoning is read) as chunk events (``stream`` decides what goes out when),
    folded into ``acc`` on the way; the last one ends with the finish reason."""
    lps = acc.add(delta)
    pieces = stream.feed(delta.text)
    if lps is not None and not pieces:
        pieces = [{}]  # the logprobs go out even while a call is held back
    events = [sse(env.chat_chunk(piece, lps if i == 0 else None, None)) for i, piece in enumerate(pieces)]
    if delta.finished:
        rest, parsed = stream.finish()
        events += [sse(env.chat_chunk(piece, None, None)) for piece in rest]
        reason = stream.finish_reason(parsed, delta.finish_reason)
        events.append(sse(env.chat_chunk({}, None, reason)))
    return events


def echoed(delta: StreamDelta, prepared: PreparedRequest) -> StreamDelta:
    """A request's first delta, with its prompt's text before it when it asked for echo
    (and its prompt's tokens and logprobs before the output's, with logprobs too)."""
    if prepared.echo is None:
        return delta
    delta = delta._replace(text=prepared.echo + delta.text)
    if prepared.echo_logprobs and delta.prompt_logprobs is not None:
        prompt = echo_logprobs(prepared.prompt_token_ids, delta.prompt_logprobs)
        delta = delta._replace(logprobs=prompt + (delta.logprobs or []))
    return delta


def opening_event(
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



def choice_event(env: Envelope, acc: Accumulator, i: int, delta: StreamDelta, lps, chat: bool) -> str:
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


def message_choice_event(env: Envelope, acc: Accumulator, i: int, delta: StreamDelta, lps,
                         stream: MessageStream) -> str:
    """Choice ``i``'s delta (already in ``acc``) of a chat whose message is read as it
    streams (its reasoning apart), as chunk events: a chunk a part of the message, the
    first with the delta's logprobs (and the prompt's, on the choice's first delta), the
    last with the finish reason; "" when the delta has nothing to send yet."""
    pieces = stream.feed(delta.text)
    reason = None
    if delta.finished:
        rest, parsed = stream.finish()
        pieces += rest
        reason = stream.finish_reason(parsed, delta.finish_reason)
    if not pieces and (lps is not None or reason is not None or delta.prompt_logprobs is not None):
        pieces = [{}]
    last = len(pieces) - 1
    chunks = [env.chat_chunk(piece, lps if j == 0 else None, reason if j == last else None, index=i)
              for j, piece in enumerate(pieces)]
    if chunks and delta.prompt_logprobs is not None:
        chunks[0]["prompt_logprobs"] = acc.prompt_logprobs
    return "".join(sse(chunk) for chunk in chunks)
