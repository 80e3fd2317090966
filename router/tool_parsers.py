"""The formats in which models write tool calls, and the schema that makes a ``required``
choice's output a list of calls.

Each parser reads one family's format from a whole output (``parse``: content and calls;
text that does not parse as calls stays content) and tells ``router.tool_calls.ToolStream``
where the call objects lie as the text grows (``call_start``, ``content_end``,
``first_object``, ``next_object``, ``object_limit``). ``parser_for_template`` picks the
parser from the format a chat template teaches:

- Hermes (Qwen2.5, Qwen3, Hermes and most others): ``<tool_call>{...}</tool_call>`` blocks;
- Llama 3 JSON: ``{"name", "parameters"}`` objects separated by ``;``;
- Mistral and Mixtral: ``[TOOL_CALLS][{"name", "arguments"}, ...]``;
- Phi-4-mini: ``functools[{"name", "arguments"}, ...]``.

Gemma 3's and Phi-3's templates render no tools; the Hermes parser reads their output.
Pure: no Ray, no torch.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import uuid
from dataclasses import dataclass, field

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_LEADING_BRACE = re.compile(r"\s*\{")
_LEADING_BRACKET = re.compile(r"\s*\[")
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


def parse_call(text: str, args_key: str) -> ToolCall | None:
    """The call a JSON object's text makes; None for anything else (JSON or not)."""
    try:
        return _call(_DECODER.decode(text), args_key)
    except ValueError:
        return None


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
            call = parse_call(m.group(1), self.args_key)
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


class JsonArrayParser:
    """Calls as one JSON array of ``{"name": ..., "arguments": {...}}`` objects after a
    marker: Mistral's ``[TOOL_CALLS]`` or Phi-4-mini's ``functools[`` (whose ``[`` opens the
    array). Text before the marker and after the array is content. An output that is an
    array from its start (after blanks) is read as the calls too, as Llama 3 JSON reads a
    leading object: Mistral's marker is a special token, in the text only when the request
    keeps special tokens. An array that does not parse as calls leaves the whole output
    content."""

    args_key = "arguments"

    def __init__(self, name: str, marker: str) -> None:
        self.name = name
        self.markers = (marker,)

    def call_start(self, text: str, since: int = 0) -> int:
        if _LEADING_BRACKET.match(text):
            return 0  # the blanks before belong to the call
        return text.find(self.markers[0], since)

    def content_end(self, text: str) -> int:
        if text.isspace():
            return 0  # a bare array may still begin
        return len(text) - _marker_prefix_len(text, self.markers)

    def array_at(self, text: str, start: int) -> int:
        """Where the array of a call start at ``start`` opens (its ``[``, or the end of
        the text when the marker is not whole yet), or STOP when it cannot."""
        marker = self.markers[0]
        i = _SPACE.match(text, start).end()
        if text.startswith(marker, i):
            return i + len(marker) - 1 if marker.endswith("[") else _JSON_WS.match(text, i + len(marker)).end()
        if marker.startswith(text[i:]):
            return len(text)  # the marker may be coming (a bare array, too)
        return i if text[i] == "[" else STOP

    def parse(self, text: str) -> Parsed:
        start = self.call_start(text)
        if start < 0:
            return _plain(text)
        at = self.array_at(text, start)
        try:
            items, end = _DECODER.raw_decode(text, at) if 0 <= at < len(text) else (None, 0)
        except ValueError:
            return _plain(text)
        calls = [_call(item, self.args_key) for item in items] if isinstance(items, list) else [None]
        if not calls or None in calls:
            return _plain(text)
        return Parsed(_content(text[:start], text[end:]), calls)

    # For ToolStream: where each call object lies, as the text grows.

    def first_object(self, text: str, start: int) -> int:
        at = self.array_at(text, start)
        if at == len(text):
            return WAIT
        return STOP if at == STOP else _object_after(text, at, "[", _JSON_WS)

    def next_object(self, text: str, end: int) -> int:
        return _object_after(text, end, ",", _JSON_WS)

    def object_limit(self, text: str, pos: int) -> tuple[int, bool]:
        return len(text), False


MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
PHI4_FUNCTOOLS = "functools["


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


ToolParser = HermesParser | Llama3JsonParser | JsonArrayParser


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
    Llama 3 (``<|python_tag|>`` or its header tokens), Mistral's when it has Mistral's
    tool tokens, Phi-4-mini's when it has Phi's tool tags, else Hermes."""
    template = template or ""
    if PYTHON_TAG in template or "<|start_header_id|>" in template:
        return Llama3JsonParser()
    if MISTRAL_TOOL_CALLS in template or "[AVAILABLE_TOOLS]" in template:
        return JsonArrayParser("mistral", MISTRAL_TOOL_CALLS)
    if "<|tool|>" in template or PHI4_FUNCTOOLS in template:
        return JsonArrayParser("phi4_mini_json", PHI4_FUNCTOOLS)
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

