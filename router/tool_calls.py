"""Tool calling: what a tool request's output means, whole or as it streams.

A chat request with ``tools`` and a ``tool_choice`` other than ``"none"`` carries a
``ToolPlan``; this module turns that request's output text into OpenAI's assistant
message parts, content and tool calls:

- ``named`` (``{"type": "function", "function": {"name": ...}}``): the grammar made the
  output the function's arguments object, so it is the one call's ``arguments``.
- ``required``: the grammar made the output a JSON array of
  ``{"name": ..., "parameters": {...}}`` objects (``required_schema``), one call each.
- ``auto``: the model chose; a parser for its family's format finds the calls, and text
  that does not parse as a call stays content. The parser comes from the chat template
  (``router.tool_parsers.parser_for_template``).

``ToolStream`` does the same for a stream: content goes out as it comes until a call
begins, then each call as vLLM's streaming parsers send it, its head (id and name) once
its name is whole, then its arguments piece by piece (``JsonRewriter`` writes them as
the whole output's parse does, so that the pieces add up to exactly its ``arguments``).
Pure: no Ray, no torch.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from typing import Literal

from router.json_rewriter import JsonRewriter
from router.tool_parsers import REQUIRED, STOP, Parsed, ToolCall, ToolParser, new_call_id, parse_call, parse_required

# -- a request's plan ------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """How to read a tool request's output: ``mode`` and, for ``named``, the function's
    name; for ``auto``, the parser; the request's function names."""

    mode: Literal["auto", "required", "named"]
    name: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True  # False: at most one call (the grammar's maxItems, or the first found)
    tools: frozenset[str] = frozenset()  # a stream sends a call before the output ends only to one of these

    def parse(self, text: str) -> Parsed:
        """The output, whole, as content and calls."""
        if self.mode == "named":
            return Parsed(None, [ToolCall(self.name, text)])
        parsed = parse_required(text) if self.mode == "required" else self.parser.parse(text)
        if not self.parallel and len(parsed.calls) > 1:
            return Parsed(parsed.content, parsed.calls[:1])
        return parsed

    def finish_reason(self, parsed: Parsed, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools and stopped by itself, but
        for a named choice, where the caller chose the call ("stop")."""
        if parsed.calls and reason == "stop" and self.mode != "named":
            return "tool_calls"
        return reason



class _Phase(enum.IntEnum):
    CONTENT = 0  # (auto) no call yet: content goes out as it comes
    CALLS = 1  # in the calls: each one's head, then its arguments, as they come
    HELD = 2  # the rest waits for ``finish``


@dataclass
class _Sent:
    """A call as far as the stream has sent it."""

    index: int
    id: str
    name: str
    arguments: str

    def delta(self, arguments: str, head: bool = False) -> dict:
        """A piece of the arguments; with ``head``, the call's first delta."""
        if head:
            part = {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": arguments}}
        else:
            part = {"index": self.index, "function": {"arguments": arguments}}
        return {"tool_calls": [part]}


def _continues(call: ToolCall, sent: _Sent) -> bool:
    """Whether ``call`` is what went out as ``sent``, and perhaps more of it."""
    return call.name == sent.name and call.arguments.startswith(sent.arguments)


def _call_delta(index: int, call: ToolCall) -> dict:
    return {"tool_calls": [{"index": index, **call.as_dict()}]}


class ToolStream:
    """A tool request's output as OpenAI's streamed deltas (``{"content": ...}`` and
    ``{"tool_calls": [...]}`` dicts), as vLLM's streaming tool parsers send them.

    ``feed`` each piece of text, then ``finish`` once. An ``auto`` stream sends content
    as it comes until a call begins (text that may be the start of one waits, and so do
    blanks, which the parse drops before a call); a ``required`` one has only calls.
    Each call then goes out as it is read (``JsonRewriter``): its head (index, id, name,
    the first of its arguments) once its name is whole and one of the request's tools
    and its arguments object has begun, then each new piece of the arguments, so that
    they add up to the parse's ``arguments`` (a call that names its function after its
    arguments, or gives them under the format's other key, goes out whole when its
    object ends). Text between and after calls, a call to a function not among the
    tools and everything after it, and calls past the first without ``parallel``, wait
    for ``finish``, which sends what the parse of the whole output says is left. A
    named call streams its arguments as they come.

    A call whose head went out may still not parse (the output was cut short, its JSON
    is broken, a later call or the text after it does not parse): the stream cannot
    take it back, so ``finish`` then sends nothing more and returns the message as
    sent (its content, and its calls with the arguments sent), where the whole output,
    not streamed, would be content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.format = plan.parser if plan.mode == "auto" else REQUIRED
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content (or as a named call's arguments)
        self.phase = _Phase.CONTENT if plan.mode == "auto" else _Phase.CALLS
        self.pos = 0  # where the next call object is looked for: the calls' start, then past each call
        self.reader: JsonRewriter | None = None  # the call object being read
        self.calls: list[_Sent] = []  # the calls whose head went out
        self.current: _Sent | None = None  # the reader's call, once its head went out
        self.named_id = new_call_id()

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        self.text += text
        if self.plan.mode == "named":
            return self._named(text)
        deltas = self._content() if self.phase is _Phase.CONTENT else []
        return deltas + self._calls() if self.phase is _Phase.CALLS else deltas

    def finish(self) -> tuple[list[dict], Parsed]:
        """The deltas left to send, and the message sent in all (for the finish reason):
        the whole output's parse, but for a call that went out and then did not parse."""
        if self.plan.mode == "named":
            return ([] if self.sent else self._named("")), self.plan.parse(self.text)
        whole = self.plan.parse(self.text)
        if not whole.calls and not self.calls:
            return self._content_to(len(self.text)), whole
        if not self._agrees(whole):
            sent = [ToolCall(c.name, c.arguments, c.id) for c in self.calls]
            return [], Parsed(self.text[:self.sent] or None, sent)
        deltas = [{"content": whole.content[self.sent:]}] if whole.content and len(whole.content) > self.sent else []
        calls = []
        for i, call in enumerate(whole.calls):
            if i < len(self.calls):
                sent = self.calls[i]
                deltas += self._arguments(sent, call.arguments[len(sent.arguments):])
                call = replace(call, id=sent.id)
            else:
                deltas.append(_call_delta(i, call))
            calls.append(call)
        return deltas, Parsed(whole.content, calls)

    def finish_reason(self, parsed: Parsed, reason: str | None) -> str | None:
        """The message's finish reason (``ToolPlan.finish_reason``) for ``finish``'s parse."""
        return self.plan.finish_reason(parsed, reason)

    def _agrees(self, whole: Parsed) -> bool:
        """Whether what went out begins the whole output's message."""
        if not (whole.content or "").startswith(self.text[:self.sent]) or len(whole.calls) < len(self.calls):
            return False
        return all(_continues(call, sent) for call, sent in zip(whole.calls, self.calls))

    def _content(self) -> list[dict]:
        """Content up to where a call may begin; the calls' reading starts where one does."""
        parser, text = self.plan.parser, self.text
        start = parser.call_start(text, max(0, self.sent - len(parser.markers[0])))
        if start < 0:
            return self._content_to(parser.content_end(text), hold_blanks=True)
        self.phase, self.pos = _Phase.CALLS, start
        return self._content_to(start) if text[:start].strip() else []

    def _content_to(self, end: int, hold_blanks: bool = False) -> list[dict]:
        piece = self.text[self.sent:end]
        piece = piece.rstrip() if hold_blanks else piece
        if not piece:
            return []
        self.sent += len(piece)
        return [{"content": piece}]

    def _calls(self) -> list[dict]:
        """Read on through the calls, one call object at a time."""
        deltas, fmt = [], self.format
        while self.phase is _Phase.CALLS:
            if self.reader is None:
                at = fmt.next_object(self.text, self.pos) if self.calls else fmt.first_object(self.text, self.pos)
                if at < 0:
                    self.phase = _Phase.HELD if at == STOP else self.phase
                    break
                self.reader = JsonRewriter(at)
            limit, final = fmt.object_limit(self.text, self.reader.pos)
            self.reader.read(self.text, limit)
            deltas += self._progress()
            if self.reader.end is None:
                if self.reader.broken or final:
                    self.phase = _Phase.HELD
                break
            self.pos, self.reader, self.current = self.reader.end, None, None
            if not self.plan.parallel:
                self.phase = _Phase.HELD
        return deltas

    def _progress(self) -> list[dict]:
        """What the call object read so far lets out."""
        reader = self.reader
        if reader.end is not None:
            return self._whole_call()
        if self.current is None:
            return self._head()
        start, end = reader.members[self.format.args_key]
        return self._arguments(self.current, reader.out[start + len(self.current.arguments):end])

    def _head(self) -> list[dict]:
        """The call's head, once its name is whole and one of the tools and its arguments
        object has begun."""
        reader = self.reader
        name_at, args_at = reader.members.get("name"), reader.members.get(self.format.args_key)
        if reader.broken or not name_at or name_at[1] is None or not args_at or len(reader.out) == args_at[0]:
            return []  # not yet (or never: a broken reader holds the stream)
        name = json.loads(reader.out[name_at[0]:name_at[1]])
        if not isinstance(name, str) or name not in self.plan.tools or reader.out[args_at[0]] != "{":
            self.phase = _Phase.HELD  # not a call, or not one to stream
            return []
        self.current = _Sent(len(self.calls), new_call_id(), name, reader.out[args_at[0]:args_at[1]])
        self.calls.append(self.current)
        return [self.current.delta(self.current.arguments, head=True)]

    def _whole_call(self) -> list[dict]:
        """A call object read whole: the call the parse makes of it, its head too if that
        has not gone out."""
        reader, sent = self.reader, self.current
        call = parse_call(self.text[reader.start:reader.end], self.format.args_key)
        if call is not None and sent is None and call.name in self.plan.tools:
            self.current = _Sent(len(self.calls), call.id, call.name, call.arguments)
            self.calls.append(self.current)
            return [self.current.delta(call.arguments, head=True)]
        if call is not None and sent is not None and _continues(call, sent):
            return self._arguments(sent, call.arguments[len(sent.arguments):])
        self.phase = _Phase.HELD
        return []

    @staticmethod
    def _arguments(call: _Sent, piece: str) -> list[dict]:
        if not piece:
            return []
        call.arguments += piece
        return [call.delta(piece)]

    def _named(self, text: str) -> list[dict]:
        """The call's head with the first arguments, then each piece of arguments."""
        first, self.sent = self.sent == 0, len(self.text)
        return [_Sent(0, self.named_id, self.plan.name, "").delta(self.text if first else text, head=first)]
