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
begins, then each call as vLLM's streaming parsers send it, its head (id and name) once
its name is whole, then its arguments piece by piece (``JsonRewriter`` writes them as
the whole output's parse does, so that the pieces add up to exactly its ``arguments``).
Pure: no Ray, no torch.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import re
import string
import uuid
from dataclasses import dataclass, field, replace
from typing import Literal

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_LEADING_BRACE = re.compile(r"\s*\{")
_JSON_WS = re.compile(r"[ \t\n\r]*")  # JSON's blanks (inside and around a JSON text)
_SPACE = re.compile(r"\s*")  # str.strip's blanks (around Llama 3's calls)
WAIT, STOP = -1, -2  # where the next call object is: not known yet; there is none to stream


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


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, unless it gives a key twice: which value counts is then unclear
    (json.loads keeps the last, a stream has already sent the first)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise ValueError("a key given twice")
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_object)


def _call(obj, args_key: str) -> ToolCall | None:
    """A ``{"name": str, <args_key>: object}`` as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _object_at(text: str, i: int, blanks: re.Pattern) -> int:
    """Where a call object begins at ``i`` (after blanks): its ``{``, WAIT or STOP."""
    i = blanks.match(text, i).end()
    if i == len(text):
        return WAIT
    return i if text[i] == "{" else STOP


def _object_after(text: str, i: int, separator: str, blanks: re.Pattern) -> int:
    """Where a call object begins after ``separator`` at ``i`` (blanks around it)."""
    i = blanks.match(text, i).end()
    if i == len(text):
        return WAIT
    return _object_at(text, i + 1, blanks) if text[i] == separator else STOP


def _content(*parts: str) -> str | None:
    text = "".join(p for p in parts if p.strip())
    return text or None


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call,
    with optional text before (content); a last block the output cut short may be
    unclosed. A block that does not parse makes the whole output content."""

    name = "hermes"
    markers = (HERMES_START,)
    args_key = "arguments"

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
                call = _call(_DECODER.decode(m.group(1)), self.args_key)
            except ValueError:
                call = None
            if call is None:
                return _plain(text)
            calls.append(call)
        outside.append(text[pos:])
        return Parsed(_content(text[:start], *outside), calls)

    # For ToolStream: where each call object lies, as the text grows.

    def first_object(self, text: str, start: int) -> int:
        return _object_at(text, start + len(HERMES_START), _JSON_WS)

    def next_object(self, text: str, end: int) -> int:
        """After a call object: its block's end, then the next block's object."""
        i = _JSON_WS.match(text, end).end()
        if not text.startswith(HERMES_END, i):
            return WAIT if HERMES_END.startswith(text[i:]) else STOP
        start = text.find(HERMES_START, i + len(HERMES_END))
        return WAIT if start < 0 else self.first_object(text, start)

    def object_limit(self, text: str, pos: int) -> tuple[int, bool]:
        """How far a call object read up to ``pos`` may go yet, and whether that is final:
        its block ends at the first ``</tool_call>``, even one inside a JSON string."""
        end = text.find(HERMES_END, pos)
        if end >= 0:
            return end, True
        return len(text) - _marker_prefix_len(text, (HERMES_END,)), False


class Llama3JsonParser:
    """Llama 3's JSON calls: ``{"name": ..., "parameters": {...}}``, several separated by
    ``;``, either the whole output or after ``<|python_tag|>`` (which is a special token:
    it is in the text only when the request keeps special tokens). Anything else, or a
    call that does not parse, leaves the whole output content."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)
    args_key = "parameters"

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

    # For ToolStream: where each call object lies, as the text grows.

    def first_object(self, text: str, start: int) -> int:
        return _object_at(text, start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start, _SPACE)

    def next_object(self, text: str, end: int) -> int:
        return _object_after(text, end, ";", _SPACE)

    def object_limit(self, text: str, pos: int) -> tuple[int, bool]:
        return len(text), False


def _json_sequence(text: str) -> list[ToolCall]:
    """The calls of ``{...}; {...}`` (a last ``;`` allowed); empty unless all of ``text``
    is such calls."""
    calls, rest = [], text.lstrip()
    while rest:
        try:
            obj, end = _DECODER.raw_decode(rest)
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
        items = _DECODER.decode(text)
    except ValueError:
        return _plain(text)
    calls = [_call(item, "parameters") for item in items] if isinstance(items, list) else [None]
    if not calls or None in calls:
        return _plain(text)
    return Parsed(None, calls)


class RequiredFormat:
    """Where the call objects of a ``required`` choice's output (a JSON array) lie, for
    ``ToolStream``, as the parsers tell it for theirs."""

    args_key = "parameters"

    def first_object(self, text: str, start: int) -> int:
        return _object_after(text, start, "[", _JSON_WS)

    def next_object(self, text: str, end: int) -> int:
        return _object_after(text, end, ",", _JSON_WS)

    def object_limit(self, text: str, pos: int) -> tuple[int, bool]:
        return len(text), False


REQUIRED = RequiredFormat()


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


# -- streaming -------------------------------------------------------------------


_LITERAL_CHARS = frozenset(string.ascii_letters + string.digits + "+-.")
_LITERAL_END = re.compile(r"[^0-9A-Za-z+\-.]")
_STRING_STOP = re.compile(r'["\\]')


class _Want(enum.IntEnum):
    """What a JSON text takes next: up to ITEM a value, up to MEMBER a key."""

    VALUE = 0  # after ":" or an array's ","
    ITEM = 1  # after "[": a value or "]"
    KEY = 2  # after an object's ","
    MEMBER = 3  # after "{": a key or "}"
    COLON = 4
    NEXT = 5  # after a value in a container: "," or the container's close


class _Token(enum.IntEnum):
    NONE = 0
    KEY = 1
    STRING = 2
    LITERAL = 3  # a number, true, false, null (or NaN and Infinity, which json takes)


def _string_stop(text: str, i: int, limit: int) -> tuple[int, bool]:
    """How far a JSON string's characters from ``i`` may be decoded now, and whether
    the string closes there: an escape waits until it is whole, and a high surrogate's
    escape until the six characters after it (its pair, perhaps) have come."""
    while m := _STRING_STOP.search(text, i, limit):
        k = m.start()
        if text[k] == '"':
            return k, True
        if k + 1 == limit or (text[k + 1] == "u" and k + 6 > limit):
            return k, False
        if text[k + 1] != "u":
            i = k + 2
        elif "d800" <= text[k + 2:k + 6].lower() <= "dbff" and k + 12 > limit:
            return k, False
        else:
            i = k + 6
    return limit, False


class JsonRewriter:
    """One JSON value read as its text arrives, and written again as ``json.dumps(value,
    ensure_ascii=False)`` writes the value ``json.loads`` makes of it, as far as that is
    certain: ``out`` only grows, since that writes each part of a value apart (blanks
    dropped, ", " and ": " between parts, a string's characters escaped each alone, a
    number or literal as Python writes what it reads).

    ``read`` goes on from where it stopped, in the same text grown longer. A string's
    characters go to ``out`` as they come, a key or a number once it ends. ``broken`` once the
    text cannot be JSON (an object that gives a key twice included); ``end``, the index
    past the value, once it is whole. For an object, ``members`` holds where each of its
    values lies in ``out`` (the end None while it is read).
    """

    def __init__(self, start: int) -> None:
        self.start = start  # the value's first character in the text
        self.pos = start  # the next character to read
        self.out = ""
        self.stack: list[set[str] | None] = []  # each open container: an object's keys so far, None for an array
        self.want = _Want.VALUE
        self.token = _Token.NONE  # a string or literal begun and not yet ended
        self.token_at = 0  # a key's or a literal's first character in the text
        self.key = ""  # the outer object's key whose value comes next
        self.members: dict[str, tuple[int, int | None]] = {}
        self.broken = False
        self.end: int | None = None

    def read(self, text: str, limit: int) -> None:
        """Read on in ``text`` up to ``limit`` (or until the value ends or breaks)."""
        more = True
        while more and self.pos < limit and self.end is None and not self.broken:
            if self.token is _Token.LITERAL:
                more = self._literal(text, limit)
            elif self.token:
                more = self._string(text, limit)
            else:
                more = self._mark(text, limit)

    def _mark(self, text: str, limit: int) -> bool:
        """The next structural character, or the start of a string or a literal."""
        i = _JSON_WS.match(text, self.pos, limit).end()
        self.pos = i
        if i == limit:
            return False
        c, want = text[i], self.want
        in_object = bool(self.stack) and self.stack[-1] is not None
        self.pos = i + 1
        if c == '"' and want <= _Want.ITEM:
            self._value_begins()
            self.token, self.out = _Token.STRING, self.out + c
        elif c == '"' and want <= _Want.MEMBER:
            self.token, self.token_at = _Token.KEY, i
        elif c in "{[" and want <= _Want.ITEM:
            self._value_begins()
            self.out += c
            self.stack.append(set() if c == "{" else None)
            self.want = _Want.MEMBER if c == "{" else _Want.ITEM
        elif c in "}]" and in_object == (c == "}") and want in (_Want.NEXT, _Want.MEMBER if in_object else _Want.ITEM):
            self.out += c
            self.stack.pop()
            self._value_ends()
        elif c == ":" and want is _Want.COLON:
            self.out, self.want = self.out + ": ", _Want.VALUE
        elif c == "," and want is _Want.NEXT:
            self.out, self.want = self.out + ", ", _Want.KEY if in_object else _Want.VALUE
        elif c in _LITERAL_CHARS and want <= _Want.ITEM:
            self._value_begins()
            self.token, self.token_at = _Token.LITERAL, i
        else:
            self.broken = True
        return True

    def _string(self, text: str, limit: int) -> bool:
        end, closed = _string_stop(text, self.pos, limit)
        if self.token is _Token.KEY:
            return closed and self._key(text, end)
        if end > self.pos:
            try:
                chars = json.loads(f'"{text[self.pos:end]}"')
            except ValueError:  # a bad escape, a raw control character
                self.broken = True
                return False
            self.out += json.dumps(chars, ensure_ascii=False)[1:-1]
            self.pos = end
        if not closed:
            return False
        self.pos, self.out = end + 1, self.out + '"'
        self._value_ends()
        return True

    def _key(self, text: str, end: int) -> bool:
        """A key, whole: it goes out once known to be new to its object."""
        try:
            key = json.loads(text[self.token_at:end + 1])
        except ValueError:
            key = None
        if key is None or key in self.stack[-1]:
            self.broken = True
            return False
        self.stack[-1].add(key)
        self.pos, self.out = end + 1, self.out + json.dumps(key, ensure_ascii=False)
        self.token, self.want = _Token.NONE, _Want.COLON
        if len(self.stack) == 1:
            self.key = key
        return True

    def _literal(self, text: str, limit: int) -> bool:
        m = _LITERAL_END.search(text, self.pos, limit)
        if m is None:
            self.pos = limit
            return False
        try:
            value = json.loads(text[self.token_at:m.start()])
        except ValueError:
            self.broken = True
            return False
        self.pos, self.out = m.start(), self.out + json.dumps(value)
        self._value_ends()
        return True

    def _value_begins(self) -> None:
        if len(self.stack) == 1 and self.stack[0] is not None:
            self.members[self.key] = (len(self.out), None)

    def _value_ends(self) -> None:
        self.token = _Token.NONE
        if not self.stack:
            self.end = self.pos
            return
        if len(self.stack) == 1 and self.stack[0] is not None:
            self.members[self.key] = (self.members[self.key][0], len(self.out))
        self.want = _Want.NEXT


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
        try:
            call = _call(_DECODER.decode(self.text[reader.start:reader.end]), self.format.args_key)
        except ValueError:
            call = None
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
