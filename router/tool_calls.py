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
  (``parser_for_template``): Llama 3 JSON for templates that speak Llama 3's format,
  Hermes (Qwen2.5, Hermes, many others) otherwise.

``ToolStream`` does the same for a stream: content goes out as it comes until a call
begins, each call goes out whole once the output is complete (a named call's arguments
stream as they come). Pure: no Ray, no torch.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_LEADING_BRACE = re.compile(r"\s*\{")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """An output split into its content (None when there is none) and its tool calls."""

    content: str | None
    calls: list[ToolCall]


def _plain(text: str) -> Parsed:
    return Parsed(text, [])


def _call(obj, args_key: str) -> ToolCall | None:
    """A ``{"name": str, <args_key>: object}`` as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _content(*parts: str) -> str | None:
    text = "".join(p for p in parts if p.strip())
    return text or None


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call,
    with optional text before (content); a last block the output cut short may be
    unclosed. A block that does not parse makes the whole output content."""

    name = "hermes"
    markers = (HERMES_START,)

    def call_start(self, text: str, since: int = 0) -> int:
        return text.find(HERMES_START, since)

    def content_end(self, text: str) -> int:
        return len(text) - _marker_prefix_len(text, self.markers)

    def parse(self, text: str) -> Parsed:
        start = text.find(HERMES_START)
        if start < 0:
            return _plain(text)
        calls, outside, pos = [], [], start
        for m in _HERMES_BLOCK.finditer(text, start):
            outside.append(text[pos:m.start()])  # between blocks
            pos = m.end()
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:
                return _plain(text)
            calls.append(call)
        outside.append(text[pos:])
        return Parsed(_content(text[:start], *outside), calls)


class Llama3JsonParser:
    """Llama 3's JSON calls: ``{"name": ..., "parameters": {...}}``, several separated by
    ``;``, either the whole output or after ``<|python_tag|>`` (which is a special token:
    it is in the text only when the request keeps special tokens). Anything else, or a
    call that does not parse, leaves the whole output content."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def call_start(self, text: str, since: int = 0) -> int:
        if _LEADING_BRACE.match(text):
            return 0  # the blanks before belong to the call
        return text.find(PYTHON_TAG, since)

    def content_end(self, text: str) -> int:
        if text.isspace():  # stops at the first other character: cheap on a long output
            return 0  # a call may still begin with "{"
        return len(text) - _marker_prefix_len(text, self.markers)

    def parse(self, text: str) -> Parsed:
        start = self.call_start(text)
        if start < 0:
            return _plain(text)
        body_at = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls = _json_sequence(text[body_at:])
        if not calls:
            return _plain(text)
        return Parsed(_content(text[:start]), calls)


def _json_sequence(text: str) -> list[ToolCall]:
    """The calls of ``{...}; {...}`` (a last ``;`` allowed); empty unless all of ``text``
    is such calls."""
    decoder, calls, rest = json.JSONDecoder(), [], text.lstrip()
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return []
        call = _call(obj, "parameters")
        if call is None:
            return []
        calls.append(call)
        rest = rest[end:].lstrip()
        if rest and not rest.startswith(";"):
            return []
        rest = rest[1:].lstrip()
    return calls


ToolParser = HermesParser | Llama3JsonParser


def _marker_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that may be a marker's beginning."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


@functools.lru_cache(maxsize=8)
def parser_for_template(template: str | None) -> ToolParser:
    """The parser for the format a chat template teaches: Llama 3 JSON when it speaks
    Llama 3 (``<|python_tag|>`` or its header tokens), else Hermes."""
    if template and (PYTHON_TAG in template or "<|start_header_id|>" in template):
        return Llama3JsonParser()
    return HermesParser()


# -- the schemas that enforce required and named choices ------------------------


EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of a ``required`` choice's output (as vLLM's): an array of at least
    one ``{"name": <one tool's name>, "parameters": <its schema>}`` (at most one without
    ``parallel``). Each tool's ``$defs`` move to the top, where its ``$ref``s point;
    ValueError when two tools define the same name differently."""
    defs: dict = {}
    options = []
    for fn in functions:
        params = copy.deepcopy(fn.get("parameters", EMPTY_PARAMETERS))
        defs_here = params.pop("$defs", {})
        if not isinstance(defs_here, dict):
            raise ValueError(f"the $defs of {fn['name']} must be an object")
        for name, schema in defs_here.items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define $defs.{name} differently; give the schemas distinct names")
        options.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str) -> Parsed:
    """A ``required`` choice's output: its calls, or all content when it does not parse
    (the output was cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return _plain(text)
    calls = [_call(item, "parameters") for item in items] if isinstance(items, list) else [None]
    if not calls or None in calls:
        return _plain(text)
    return Parsed(None, calls)


# -- a request's plan ------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """How to read a tool request's output: ``mode`` and, for ``named``, the function's
    name; for ``auto``, the parser."""


    mode: Literal["auto", "required", "named"]
    name: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True  # False: at most one call (the grammar's maxItems, or the first found)

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


def _call_delta(index: int, call: ToolCall) -> dict:
    return {"tool_calls": [{"index": index, **call.as_dict()}]}


class ToolStream:
    """A tool request's output as OpenAI's streamed deltas (``{"content": ...}`` and
    ``{"tool_calls": [...]}`` dicts).

    ``feed`` each piece of text, then ``finish`` once; content goes out until a call
    begins (text that may be the start of one waits), the calls once complete.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content (or as a named call's arguments)
        self.in_call = False  # a call has begun: the rest waits for ``finish``
        self.named_id = new_call_id()

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        self.text += text
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required" or self.in_call:
            return []
        parser = self.plan.parser
        start = parser.call_start(self.text, max(0, self.sent - len(parser.markers[0])))
        if start >= 0:
            self.in_call = True
            end = start
        else:
            end = parser.content_end(self.text)
        return self._content_to(end)

    def finish(self) -> tuple[list[dict], Parsed]:
        """The deltas left to send, and the whole output parsed (for the finish reason)."""
        if self.plan.mode == "named":
            return ([] if self.sent else self._named("")), self.plan.parse(self.text)
        parsed = self.plan.parse(self.text)
        if not parsed.calls:
            return self._content_to(len(self.text)), parsed
        deltas = []
        sent = self.text[: self.sent]
        if parsed.content and parsed.content.startswith(sent) and len(parsed.content) > len(sent):
            deltas.append({"content": parsed.content[len(sent):]})
        return deltas + [_call_delta(i, call) for i, call in enumerate(parsed.calls)], parsed

    def _content_to(self, end: int) -> list[dict]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [{"content": piece}]

    def _named(self, text: str) -> list[dict]:
        """The call's head with the first arguments, then each piece of arguments."""
        if self.sent == 0:
            self.sent = len(self.text)
            head = {"index": 0, "id": self.named_id, "type": "function",
                    "function": {"name": self.plan.name, "arguments": self.text}}
            return [{"tool_calls": [head]}]
        self.sent = len(self.text)
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
