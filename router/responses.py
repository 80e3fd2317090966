"""The Responses API's requests (``POST /v1/responses``), as chat completions underneath.

A request becomes a chat: its ``instructions`` a system message, then the conversation of
the response ``previous_response_id`` names (from ``router.response_store``; that
response's instructions are not carried over, as OpenAI's are not), then ``input`` (text:
one user message; or items, below) as messages. Function ``tools`` (flat, as the
Responses API writes them), ``tool_choice``, ``parallel_tool_calls``, ``text.format``
(``response_format``) and ``max_output_tokens`` (``max_tokens``) map onto the chat's
fields, and ``router.validation.prepare_chat`` checks it all; its 400s name the Responses
API's fields (``input.2.arguments``, ``text.format.schema``: ``_renamed``).

Input items, in order:

- ``message`` (``{"role", "content"}``, its ``type`` optional): content as text, or
  ``input_text`` / ``output_text`` parts, joined;
- ``function_call`` (``call_id``, ``name``, ``arguments``): a call of the assistant's
  (several in a row, and those after an assistant message, make one assistant turn);
- ``function_call_output`` (``call_id``, ``output``): a tool message;
- ``reasoning`` (``content``'s ``reasoning_text`` parts): the thinking of the assistant
  turn that follows it, to the chat template as ``reasoning_content``.

Other items, tools and formats (images, files, built-in tools) are a 400 naming them,
as is ``background``. vLLM's sampling fields (``top_k``, ``seed``, ``stop``,
``chat_template_kwargs``, ``guided_regex``, ...) pass on to the chat as they are. Pure, as
``router.validation``: no Ray, no network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.bodies import TOOL_NAME, parse_as
from router.errors import ApiError
from router.response_store import ResponseStore
from router.validation import PreparedRequest, ServedModel, prepare_chat

# Fields a request may give that the chat takes as they are (vLLM's extras among them).
PASSED_ON = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
             "allowed_token_ids", "bad_words", "priority", "chat_template_kwargs", "skip_special_tokens",
             "guided_json", "guided_regex", "guided_choice", "guided_grammar")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ResponsesTool(_Strict):
    """A function the model may call, as the Responses API writes it (flat)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    """``text``: the output's ``format`` (checked by ``_response_format``)."""

    format: dict | None = None


class ResponsesBody(_Strict):
    """A ``/v1/responses`` body; ``prepare_response`` checks what the types cannot."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    stream: bool = False
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict | None = None


class TextPart(_Strict):
    """A text part of an input message's (or a replayed output message's) content."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Strict):
    """A ``message`` item."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A ``function_call`` item: a call the assistant made earlier."""

    call_id: str
    name: str = Field(pattern=TOOL_NAME)
    arguments: str


class FunctionCallOutputItem(_Strict):
    """A ``function_call_output`` item: what a call gave back."""

    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Strict):
    """A ``reasoning_text`` part of a ``reasoning`` item."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """A ``reasoning`` item: the thinking that led to the next assistant turn."""

    content: list[ReasoningText] | None = None


@dataclass(frozen=True)
class ResponseRequest:
    """A validated Responses API request: the chat request it runs as, what the response
    object repeats of it (``fields``), and the conversation before its output (for the
    stored response: its instructions left out)."""

    prepared: PreparedRequest
    fields: dict
    history: tuple[dict, ...]
    store: bool


# -- input items as chat messages --------------------------------------------------


class _Conversation:
    """Chat messages made of items, and where each came from (chat path -> Responses
    path, for ``_renamed``)."""

    def __init__(self, offset: int) -> None:
        self.messages: list[dict] = []
        self.paths: dict[str, str] = {}
        self.offset = offset  # the index of the first message in the whole chat
        self.reasoning: tuple[str, str] | None = None  # (thinking, its item's path) for the next assistant turn

    def add(self, item: object, where: str) -> None:
        if not isinstance(item, dict):
            raise ApiError(400, f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        _check_parts(item.get("content" if kind == "message" else "output"), where, kind)
        if kind == "message":
            self._message(parse_as(InputMessage, item, where), where)
        elif kind == "function_call":
            self._call(parse_as(FunctionCallItem, item, where), where)
        elif kind == "function_call_output":
            out = parse_as(FunctionCallOutputItem, item, where)
            at = self._append({"role": "tool", "tool_call_id": out.call_id, "content": out.text()}, where)
            self.paths[f"{at}.content"] = f"{where}.output"
        elif kind == "reasoning":
            parts = parse_as(ReasoningItem, item, where).content or []
            self.reasoning = ("".join(p.text for p in parts), where) if parts else None
        else:
            raise ApiError(400, f"{where}.type must be one of {', '.join(ITEM_TYPES)}, got {kind!r}: this server "
                           "serves text and function calls", param=f"{where}.type")

    def _append(self, message: dict, where: str) -> str:
        """Add ``message``; an assistant turn takes the thinking of a reasoning item right
        before it (any other item drops it)."""
        at = f"messages.{self.offset + len(self.messages)}"
        if message["role"] == "assistant" and self.reasoning is not None:
            message["reasoning_content"], self.paths[f"{at}.reasoning_content"] = self.reasoning
        self.reasoning = None
        self.messages.append(message)
        self.paths[at] = where
        return at

    def _message(self, m: InputMessage, where: str) -> None:
        self._append({"role": m.role, "content": m.text()}, where)

    def _call(self, call: FunctionCallItem, where: str) -> None:
        """A call joins the assistant turn just before it, or starts one."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            self._append({"role": "assistant", "content": None}, where)
            last = self.messages[-1]
        self.reasoning = None
        calls = last.setdefault("tool_calls", [])
        at = f"messages.{self.offset + len(self.messages) - 1}.tool_calls.{len(calls)}.function"
        calls.append({"id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}})
        self.paths[at] = where


def _check_parts(parts: object, where: str, kind: object) -> None:
    """400 naming a content part of a message (or a call's output) that is not text."""
    if not isinstance(parts, list):
        return
    field = "content" if kind == "message" else "output"
    for k, part in enumerate(parts):
        got = part.get("type") if isinstance(part, dict) else None
        if got not in ("input_text", "output_text"):
            raise ApiError(400, f"{where}.{field}.{k}.type must be 'input_text' or 'output_text', got {got!r}: "
                           "this server serves text", param=f"{where}.{field}.{k}.type")


def conversation(items: list, offset: int = 0, at: str = "input") -> _Conversation:
    """Items (a request's input, or a response's output) as chat messages, the first at
    index ``offset`` of the chat; 400 naming the item that does not fit."""
    conv = _Conversation(offset)
    for j, item in enumerate(items):
        conv.add(item, f"{at}.{j}")
    return conv


# -- the request's other fields ----------------------------------------------------


def _tool_choice(choice: Any) -> Any:
    """The chat's ``tool_choice`` for the Responses API's (its named function flat)."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def _response_format(text: TextConfig | None) -> dict | None:
    """The chat's ``response_format`` for ``text.format``; 400 naming its field."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") != "json_schema":
        raise ApiError(400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got "
                       f"{fmt.get('type')!r}", param="text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "text.format.schema must be a JSON schema object", param="text.format.schema")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _chat_tools(tools: list[ResponsesTool] | None) -> list[dict] | None:
    if tools is None:
        return None
    return [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in tools]


def _echoed(b: ResponsesBody, body: dict) -> dict:
    """What the response object repeats of the request."""
    return {
        "instructions": b.instructions,
        "max_output_tokens": b.max_output_tokens,
        "metadata": b.metadata or {},
        "parallel_tool_calls": b.parallel_tool_calls,
        "previous_response_id": b.previous_response_id,
        "reasoning": b.reasoning or {"effort": None, "summary": None},
        "store": b.store,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": (b.text.format if b.text and b.text.format else {"type": "text"})},
        "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
        "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": b.user,
    }


# -- errors in the Responses API's words ---------------------------------------------

# A chat field's path in an error's text: not a part of a longer path, nor a quoted name.
_CHAT_PATH = re.compile(r"(?<![\w.'])(?:messages|max_tokens|response_format|tools|tool_choice)(?:\.[\w$]+)*")
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)
_TOOL_FUNCTION = re.compile(r"^tools\.(\d+)\.function\b")


def _rename_path(path: str, paths: dict[str, str]) -> str:
    """A chat request's field path as the Responses request's: a message's by the item
    it came from (the longest known prefix), the others by ``_RENAMES``."""
    parts = path.split(".")
    for n in range(len(parts), 1, -1):
        head = ".".join(parts[:n])
        if head in paths:
            return ".".join([paths[head], *parts[n:]])
    for old, new in _RENAMES:
        if path == old or path.startswith(old + "."):
            return new + path[len(old):]
    return _TOOL_FUNCTION.sub(r"tools.\1", path)


def _renamed(e: ApiError, paths: dict[str, str]) -> ApiError:
    """The chat's error ``e`` naming the Responses request's fields."""
    def rename(text: str) -> str:
        return _CHAT_PATH.sub(lambda m: _rename_path(m[0], paths), text)

    return ApiError(e.status, rename(e.message), rename(e.param) if e.param else e.param, e.type, e.code,
                    e.retry_after_s)


# -- the request -----------------------------------------------------------------------


def _history(store: ResponseStore, previous: str | None) -> tuple[dict, ...]:
    if previous is None:
        return ()
    stored = store.get(previous)
    if stored is None:
        raise ApiError(404, f"previous_response_id: no stored response has the id {previous!r} (it was never "
                       "stored, was deleted, or was pushed out of the store)", param="previous_response_id",
                       code="response_not_found")
    return stored.history


def _check_supported(b: ResponsesBody) -> None:
    if isinstance(b.input, list) and not b.input:
        raise ApiError(400, "input holds no items: send text, or at least one item", param="input")
    if b.background:
        raise ApiError(400, "background responses are not served: leave background out or false",
                       param="background")


def prepare_response(store: ResponseStore, body: dict, model: ServedModel, tokenizer) -> ResponseRequest:
    """Validate a ``/v1/responses`` body into the chat request it runs as; raises
    ``ApiError`` naming the Responses API's field."""
    b: ResponsesBody = parse_as(ResponsesBody, body)
    _check_supported(b)
    history = _history(store, b.previous_response_id)
    head = [{"role": "system", "content": b.instructions}] if b.instructions is not None else []
    if isinstance(b.input, str):
        conv = _Conversation(len(head) + len(history))
        conv.add({"role": "user", "content": b.input}, "input")
        conv.paths[f"messages.{conv.offset}.content"] = "input"
    else:
        conv = conversation(b.input, len(head) + len(history))
    paths = {f"messages.{i}": "previous_response_id" for i in range(len(head), len(head) + len(history))}
    paths.update(conv.paths)
    if head:
        paths.update({"messages.0": "instructions", "messages.0.content": "instructions"})
    chat = {name: body[name] for name in PASSED_ON if name in body}
    chat.update(model=b.model, messages=head + list(history) + conv.messages, stream=b.stream,
                max_tokens=b.max_output_tokens, tools=_chat_tools(b.tools), tool_choice=_tool_choice(b.tool_choice),
                parallel_tool_calls=b.parallel_tool_calls, response_format=_response_format(b.text))
    try:
        prepared = prepare_chat({k: v for k, v in chat.items() if v is not None}, model, tokenizer)
    except ApiError as e:
        raise _renamed(e, paths) from None
    if prepared.structured_field is not None:
        prepared = replace(prepared, structured_field=_rename_path(prepared.structured_field, paths))
    return ResponseRequest(prepared, _echoed(b, body), tuple(history) + tuple(conv.messages), b.store)


def output_history(request: ResponseRequest, output: list[dict]) -> tuple[dict, ...]:
    """The conversation a response ends: its request's, then its output items as messages."""
    return request.history + tuple(conversation(output, at="output").messages)

