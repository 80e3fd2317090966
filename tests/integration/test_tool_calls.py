"""Tool calling through the live service with the official ``openai`` client.

The module serves the tiny random model with a Qwen2.5-style chat template that renders
tools (``tests.helpers.TOOL_CHAT_TEMPLATE``). Its weights are random, so only the
choices the grammar enforces are checked here (named and required: the calls must
parse and match their function's schema), whole and streamed (a streamed call's
argument pieces add up to the unstreamed call of the same seed); "auto" parsing and
streaming are unit-tested (tests/unit/test_tool_calls.py). Every test ends with no KV blocks in use.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.helpers import TOOL_CHAT_TEMPLATE, with_chat_template

pytestmark = pytest.mark.usefixtures("no_blocks_left")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
HISTORY = [
    {"role": "user", "content": "Weather in Oslo, then the time there?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "4C, rain"},
]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tiny_model(tiny_model, tmp_path_factory) -> str:
    """The session's tiny model, with a chat template that renders tools."""
    return str(with_chat_template(Path(tiny_model), tmp_path_factory.mktemp("tiny-llama-tools"), TOOL_CHAT_TEMPLATE))


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, f"a call to {name!r}, which is not a tool"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _create(client, model_name, **kwargs):
    return client.chat.completions.create(model=model_name, messages=HISTORY, tools=TOOLS, max_tokens=60, **kwargs)


def test_named_and_required_choices_return_calls_that_match_the_schemas(client, model_name):
    for seed in (0, 1):
        named = _create(client, model_name, tool_choice=NAMED, temperature=1.0, seed=seed).choices[0]
        assert named.finish_reason == "stop" and named.message.content is None, named
        [call] = named.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_time"
        _check_call(call.function.name, call.function.arguments)

        required = _create(client, model_name, tool_choice="required", parallel_tool_calls=False,
                           temperature=1.0, seed=seed).choices[0]
        assert required.finish_reason == "tool_calls", required
        [call] = required.message.tool_calls
        _check_call(call.function.name, call.function.arguments)


def _streamed(client, model_name, **kwargs) -> tuple[dict[int, dict], list[str], object]:
    """The calls a stream sent (by index, with the number of deltas each came in), its
    finish reasons and its usage."""
    calls: dict[int, dict] = {}
    reasons, usage = [], None
    for chunk in _create(client, model_name, stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasons += [choice.finish_reason] if choice.finish_reason else []
            assert not choice.delta.content, f"content in a constrained call: {choice.delta}"
            for part in choice.delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": "",
                                                     "pieces": 0})
                call["arguments"] += part.function.arguments or ""
                call["pieces"] += 1
    return calls, reasons, usage


def test_streamed_named_and_required_calls_assemble_into_calls_that_match(client, model_name):
    calls, reasons, usage = _streamed(client, model_name, tool_choice=NAMED, temperature=0.0)
    assert reasons == ["stop"] and list(calls) == [0] and calls[0]["name"] == "get_time"
    assert calls[0]["id"].startswith("call_")
    _check_call("get_time", calls[0]["arguments"])
    assert usage is not None and usage.completion_tokens > 0

    calls, reasons, _ = _streamed(client, model_name, tool_choice="required", parallel_tool_calls=False, seed=5)
    assert reasons == ["tool_calls"] and list(calls) == [0], (reasons, calls)
    _check_call(calls[0]["name"], calls[0]["arguments"])
    [whole] = _create(client, model_name, tool_choice="required", parallel_tool_calls=False, seed=5).choices[0] \
        .message.tool_calls
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments), \
        "the streamed pieces add up to the unstreamed call of the same seed"
    assert calls[0]["pieces"] > 3, f"the arguments {calls[0]['arguments']!r} came in {calls[0]['pieces']} deltas"


def test_tool_choice_none_answers_in_text_and_bad_choices_or_schemas_are_400(http, model_name):
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": HISTORY, "tools": TOOLS,
                                                "tool_choice": "none", "max_tokens": 5})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": HISTORY, "tools": TOOLS,
                                                "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name", r.text
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": HISTORY, "tools": bad_schema,
                                                "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
