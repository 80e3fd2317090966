"""A chat request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked
(400 naming the field), the functions for the chat template (HF's convention), and how to
read the output (``ToolPlan``): a required or named choice becomes an output constraint
(the schemas are ``router.tool_parsers``'), ``auto`` a parser the chat template calls for."""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.wire.sampling_params import StructuredOutput
from router.bodies import ChatBody, ToolDef
from router.errors import ApiError
from router.output_constraints import structured_output
from router.tool_calls import ToolPlan
from router.tool_parsers import EMPTY_PARAMETERS, parser_for_template, required_schema

_CHOICE_SHAPE = "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"


def _tool_choice(b: ChatBody) -> tuple[str, str | None]:
    """(mode, function name): the request's ``tool_choice``, defaulted as OpenAI's ("auto"
    with tools, "none" without); 400 naming ``tool_choice``."""
    choice, names = b.tool_choice, [t.function.name for t in b.tools or ()]
    if choice is None or choice in ("none", "auto"):
        return ("auto" if names and choice != "none" else "none"), None
    if choice == "required":
        name = None
    elif isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
    else:
        raise ApiError(400, f"tool_choice must be {_CHOICE_SHAPE}, got {json.dumps(choice)[:100]}",
                       param="tool_choice")
    if not names:
        raise ApiError(400, "tool_choice requires tools: the request has none to call", param="tool_choice")
    if name is not None and name not in names:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                       f"({', '.join(names)})", param="tool_choice.function.name")
    return ("named" if name else "required"), name


def _functions(tools: list[ToolDef]) -> list[dict]:
    """The tools' functions as dicts, ``parameters`` defaulted; 400 for a name used twice."""
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.function.model_dump(exclude_none=True)
        if fn["name"] in seen:
            raise ApiError(400, f"tools.{i}.function.name: {fn['name']!r} names two tools; names must be unique",
                           param=f"tools.{i}.function.name")
        seen.add(fn["name"])
        fn.setdefault("parameters", EMPTY_PARAMETERS)
        functions.append(fn)
    return functions


def _tool_output(
    mode: str, name: str | None, functions: list[dict], b: ChatBody,
) -> tuple[str, StructuredOutput] | None:
    """(field, constraint) enforcing a required or named choice (None for auto); 400 naming
    ``tool_choice`` when the request constrains its output another way too."""
    if mode == "auto":
        return None
    if structured_output(b) is not None:
        raise ApiError(400, f"tool_choice {mode!r} shapes the output itself: it cannot go with "
                       "response_format or guided_*", param="tool_choice")
    if mode == "named":
        i = next(i for i, fn in enumerate(functions) if fn["name"] == name)
        return f"tools.{i}.function.parameters", StructuredOutput.json_schema(functions[i]["parameters"])
    try:
        return "tools", StructuredOutput.json_schema(required_schema(functions, b.parallel_tool_calls))
    except ValueError as e:
        raise ApiError(400, f"tools: {e}", param="tools") from None


@dataclass(frozen=True)
class ChatTools:
    """A chat request's tools as validation settled them."""

    template_tools: list[dict] | None = None  # for the chat template; None: left out
    plan: ToolPlan | None = None  # how to read the output; None: plain content
    output: tuple[str, StructuredOutput] | None = None  # (field, constraint) of required / named


def chat_tools(b: ChatBody, tokenizer) -> ChatTools:
    """What the request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for.
    ``tool_choice`` "none" leaves the tools out of the prompt, as if there were none."""
    mode, name = _tool_choice(b)
    if mode == "none":
        return ChatTools()
    functions = _functions(b.tools)
    parser = parser_for_template(tokenizer.chat_template) if mode == "auto" else None
    plan = ToolPlan(mode, name, parser, b.parallel_tool_calls, frozenset(fn["name"] for fn in functions))
    return ChatTools(_template_tools(functions), plan, _tool_output(mode, name, functions, b))


def _template_tools(functions: list[dict]) -> list[dict]:
    return [{"type": "function", "function": fn} for fn in functions]


def template_tools(tools: list[ToolDef] | None) -> list[dict] | None:
    """The tools as the chat template takes them (HF's convention); None without tools."""
    return _template_tools(_functions(tools)) if tools else None
