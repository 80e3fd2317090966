"""The request bodies as pydantic models (strict types, unknown fields ignored, as OpenAI
clients send extras), and reading a body: JSON first (413 over the size limit, 400 when
malformed or nested more than ``MAX_JSON_DEPTH`` levels), then the model (400 naming the
first field that does not fit). What the types cannot check is ``router.validation``'s.

The depth bound keeps every later step off Python's recursion limit: the JSON decoder
stops near 1000 levels, but pydantic, ``json.dumps`` (a schema becomes a spec's text) and
the chat template's ``tojson`` recurse too, and failed (a 500) from about 500 levels. JSON
text inside a string (a tool call's ``arguments``, gRPC's ``response_format``) is held to
the same bound (``check_depth``)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.errors import ApiError

MAX_JSON_DEPTH = 128  # objects and arrays inside one another; a JSON schema's own bound is 64 (GrammarLimits)


def check_depth(value: object, what: str, param: str | None = None) -> None:
    """400 naming ``what`` (and ``param``) when ``value`` (parsed JSON) nests objects and
    arrays more than ``MAX_JSON_DEPTH`` levels deep. Iterative: no depth overflows it."""
    todo = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"{what} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep, "
                           "over the limit", param=param)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def check_text(text: str, param: str) -> str:
    """400 for text that is not Unicode: JSON's \\ud800 escapes can give lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"{param} is not valid Unicode: a lone surrogate at character {e.start}", param=param
        ) from None
    return text



class SamplingBody(BaseModel):
    """The fields both endpoints take: sampling, stop conditions, token controls, output
    constraints, streaming, ``n`` and ``priority`` (the base of ``CompletionBody`` and
    ``ChatBody``)."""

    # Strict: "0.5" is not a number. Unknown fields are ignored, as OpenAI clients send extras.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs, with this many top tokens
    priority: int = 0  # vLLM's: lower is served first, under the ``priority`` scheduling policy


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with token counts."""

    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class CompletionBody(SamplingBody):
    """A ``/v1/completions`` body (gRPC's Generate is turned into one); ``prepare_completions``
    checks what the types cannot."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class TextPart(BaseModel):
    """A text part of a message whose ``content`` is a list of parts."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    """The function an earlier tool call named, with its arguments as JSON text."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=TOOL_NAME)
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A tool call an earlier assistant message made, sent back in ``messages``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """One message of a chat request; ``for_template`` checks it and gives it the
    chat template's shape."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier thinking (templates may show it)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self, i: int) -> dict:
        """The message as chat templates take it (HF's convention, as vLLM hands it
        over): a call's ``arguments`` as an object; 400 naming the field."""
        out = {"role": self.role, "content": check_text(self.text(), f"messages.{i}.content")}
        if self.tool_calls:
            if self.role != "assistant":
                raise ApiError(400, f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                               param=f"messages.{i}.tool_calls")
            out["tool_calls"] = [_template_call(call, f"messages.{i}.tool_calls.{j}")
                                 for j, call in enumerate(self.tool_calls)]
        if self.role == "tool":
            if self.tool_call_id is None or self.content is None:
                missing = "tool_call_id" if self.tool_call_id is None else "content"
                raise ApiError(400, f"messages.{i}.{missing}: a tool message needs tool_call_id and content",
                               param=f"messages.{i}.{missing}")
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            if self.role != "assistant":
                raise ApiError(400, f"messages.{i}.reasoning_content: only assistant messages carry reasoning",
                               param=f"messages.{i}.reasoning_content")
            out["reasoning_content"] = check_text(self.reasoning_content, f"messages.{i}.reasoning_content")
        return out


def _template_call(call: MessageToolCall, path: str) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{path}.function.arguments must be a JSON object, as text",
                       param=f"{path}.function.arguments")
    check_depth(arguments, f"{path}.function.arguments", f"{path}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class FunctionDef(BaseModel):
    """A function a chat request offers the model: its name, description and
    parameters as a JSON schema."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: no parameters
    strict: bool | None = None


class ToolDef(BaseModel):
    """One entry of a chat request's ``tools``: a function the model may call."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class ChatBody(SamplingBody):
    """A ``/v1/chat/completions`` body; ``prepare_chat`` checks what the types cannot."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Any = None  # checked by ``_tool_choice``, for messages clearer than a union's
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the chat template (``{"enable_thinking": false}`` for Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None


SamplingBody.model_rebuild()
CompletionBody.model_rebuild()
ChatBody.model_rebuild()

_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}


def _field_path(loc: tuple) -> str:
    """``('prompt', 'list[int]', 1)`` -> ``prompt.1``: the union member names are noise."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    return ".".join(parts)


def parse_json(raw: bytes, max_bytes: int) -> dict:
    """The request body as a JSON object; 413 over the size limit, 400 when malformed."""
    if len(raw) > max_bytes:
        raise ApiError(413, f"request body is {len(raw)} bytes, over the limit of {max_bytes} bytes")
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # else it cannot nest that deep: no walk
        check_depth(body, "request body")
    return body


def parse_as(model_cls: type[BaseModel], body: dict, at: str = "") -> Any:
    """``body`` as ``model_cls``; 400 naming the first field that does not fit (under
    ``at``, the path of ``body`` in the request, when it is a part of one)."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        path = ".".join(p for p in (at, _field_path(err["loc"])) if p)
        raise ApiError(400, f"{path}: {err['msg']}", param=path) from None
