"""The Responses API's answers: the response object, its output items, and a streamed
response's typed events.

Output items, in order: a ``reasoning`` item (the thinking, as one ``reasoning_text``
part) when the request's reasoning is read, a ``message`` item (the answer, as one
``output_text`` part) unless the output is only calls or only thinking, and a
``function_call`` item a call. A response whose output ran into ``max_output_tokens``
is ``incomplete`` (``incomplete_details.reason`` says so), its last item too.

A stream (``ResponseEvents``) sends OpenAI's events, each with its ``sequence_number``::

    response.created ─▶ response.in_progress
      ─▶ for each item: response.output_item.added
           reasoning: content_part.added ─▶ reasoning_text.delta ... ─▶ reasoning_text.done ─▶ content_part.done
           message:   content_part.added ─▶ output_text.delta ...    ─▶ output_text.done    ─▶ content_part.done
           call:      function_call_arguments.delta ...  ─▶ function_call_arguments.done
         ─▶ response.output_item.done
      ─▶ response.completed | response.incomplete   (or error ─▶ response.failed)

An item opens with the first piece of its kind (``router.chat_output.MessageStream``'s
deltas) and closes when another opens or the output ends; the last event carries the
whole response, its output the items as they were streamed. Pure: no Ray, no network.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from router.chat_output import Message, MessageStream
from router.errors import ApiError
from router.openai_api import Accumulator

_json = json.JSONEncoder(separators=(",", ":")).encode


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseHead:
    """What every shape of one response shares: its id, creation time, model, and the
    request's fields it repeats (``router.responses.ResponseRequest.fields``)."""

    id: str
    created_at: int
    model: str
    fields: dict

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model, "output": output, "usage": usage, **self.fields,
        }


def status_of(reason: str | None) -> tuple[str, str | None]:
    """(status, why it is incomplete) of a response whose output ended for ``reason``."""
    return ("incomplete", "max_output_tokens") if reason == "length" else ("completed", None)


def usage(acc: Accumulator, reasoning_tokens: int) -> dict:
    """The Responses API's usage: input (and cached) and output (and reasoning) tokens."""
    return {
        "input_tokens": acc.prompt_tokens,
        "input_tokens_details": {"cached_tokens": acc.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": acc.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": acc.prompt_tokens + acc.completion_tokens,
    }


def _text_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(kind: str, status: str = "in_progress", text: str | None = None) -> dict:
    """A new reasoning or message item (its one part when ``text`` is given)."""
    content = [] if text is None else [_text_part(kind, text)]
    if kind == "reasoning":
        return {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "content": content, "status": status}


def _call_item(call_id: str, name: str, arguments: str, status: str = "in_progress") -> dict:
    return {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: Message, status: str) -> list[dict]:
    """A whole output's items, the last one with the response's ``status``."""
    items = [_item("reasoning", "completed", message.reasoning)] if message.reasoning is not None else []
    if message.content or not (message.calls or items):
        items.append(_item("message", "completed", message.content or ""))
    items += [_call_item(call.id, call.name, call.arguments, "completed") for call in message.calls]
    items[-1]["status"] = status
    return items


def reasoning_text(output: list[dict]) -> str:
    """The thinking in a response's output items."""
    return "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])


def whole_response(head: ResponseHead, message: Message, acc: Accumulator, count: Callable[[str], int]) -> dict:
    """The response to an output read whole; ``count``: the tokens of a text."""
    status, incomplete = status_of(message.finish_reason)
    output = output_items(message, status)
    return head.response(status, output, usage(acc, count(message.reasoning or "")), incomplete)


class ResponseEvents:
    """A streamed response's events (as server-sent events, ``event:`` and ``data:``),
    from its output's text as ``stream`` reads it; ``output`` holds the items as sent."""

    def __init__(self, head: ResponseHead, stream: MessageStream) -> None:
        self.head = head
        self.stream = stream
        self.seq = 0
        self.output: list[dict] = []
        self.open: int | None = None  # the item still growing
        self.calls: dict[int, int] = {}  # a tool call's index -> its item's

    def opening(self) -> str:
        response = self.head.response("in_progress", [])
        return self._event("response.created", response=response) + \
            self._event("response.in_progress", response=response)

    def feed(self, text: str) -> str:
        return "".join(self._delta(d) for d in self.stream.feed(text))

    def finish(self, reason: str | None, acc: Accumulator, count: Callable[[str], int]) -> tuple[str, dict]:
        """The last events of an output that ended for ``reason``, and the response."""
        rest, parsed = self.stream.finish()
        events = "".join(self._delta(d) for d in rest)
        if not self.output:  # an empty output is an empty message, as a whole one's
            events += self._start("message")
        status, incomplete = status_of(self.stream.finish_reason(parsed, reason))
        events += self._close(status)
        response = self.head.response(status, self.output, usage(acc, count(reasoning_text(self.output))), incomplete)
        return events + self._event(f"response.{status}", response=response), response

    def failed(self, error: ApiError) -> str:
        """The events of a response that failed: the error, then the response so far."""
        events = self._event("error", code=error.code or error.type, message=error.message, param=error.param)
        response = self.head.response("failed", self.output, error={"code": "server_error", "message": error.message})
        return events + self._event("response.failed", response=response)

    def _event(self, kind: str, **fields) -> str:
        data = _json({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def _delta(self, delta: dict) -> str:
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"])
        return "".join(self._call(part) for part in delta.get("tool_calls", ()))

    def _text(self, kind: str, text: str) -> str:
        """A piece of thinking or answer: its item opened first when another one is open."""
        events = ""
        if self.open is None or self.output[self.open]["type"] != kind:
            events += self._close("completed") + self._start(kind)
        at = self.open
        item = self.output[at]
        item["content"][0]["text"] += text
        extra = {} if kind == "reasoning" else {"logprobs": []}
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return events + self._event(name, item_id=item["id"], output_index=at, content_index=0, delta=text, **extra)

    def _start(self, kind: str) -> str:
        item = _item(kind)
        self.output.append(item)
        self.open = at = len(self.output) - 1
        part = _text_part(kind, "")
        events = self._event("response.output_item.added", output_index=at, item=item)
        events += self._event("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                              part=part)
        item["content"].append(part)
        return events

    def _call(self, part: dict) -> str:
        """A tool call's delta: its head opens its item, its arguments are deltas."""
        events, fn = "", part.get("function", {})
        if "id" in part:
            events += self._close("completed")
            item = _call_item(part["id"], fn["name"], "")
            self.output.append(item)
            self.open = self.calls[part["index"]] = len(self.output) - 1
            events += self._event("response.output_item.added", output_index=self.open, item=item)
        arguments = fn.get("arguments") or ""
        if arguments:
            at = self.calls[part["index"]]
            item = self.output[at]
            item["arguments"] += arguments
            events += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                  delta=arguments)
        return events

    def _close(self, status: str) -> str:
        """The open item's closing events, with ``status``; "" when none is open."""
        if self.open is None:
            return ""
        at, self.open = self.open, None
        item = self.output[at]
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": at}
        if item["type"] == "function_call":
            events = self._event("response.function_call_arguments.done", arguments=item["arguments"], **ids)
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events = self._event(done, content_index=0, text=part["text"], **ids, **extra)
            events += self._event("response.content_part.done", content_index=0, part=part, **ids)
        return events + self._event("response.output_item.done", output_index=at, item=item)
