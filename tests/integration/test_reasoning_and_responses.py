"""Reasoning output and the Responses API through the live service, with the official
``openai`` client.

The module serves a random-weight Qwen3 checkpoint whose chat template thinks as
Qwen3's does (``<think>`` blocks for an assistant's ``reasoning_content``, an empty
closed block in the prompt with ``enable_thinking: false``) and renders tools as
Hermes blocks, so the router's ``auto`` reasoning parser is on. Its weights are random:
a test forces what the model writes with ``guided_regex`` (vLLM's), and checks how the
router reads it: the thinking in ``reasoning_content`` (chat) and reasoning items
(responses), the answer and the tool calls after it, streamed and not. The service
takes an API key (the clients here send it). Every test ends with no KV blocks in use.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from router.server import RouterConfig
from tests.helpers import build_hf_checkpoint, with_chat_template

pytestmark = pytest.mark.usefixtures("no_blocks_left")

API_KEY = "sk-responses-test"

QWEN3_STYLE_TEMPLATE = """\
{%- if tools %}<|system|>
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|end|>
{% elif messages[0].role == 'system' %}<|system|>
{{ messages[0].content }}<|end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|assistant|>
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|end|>
{% elif message.role == 'tool' %}<|user|>
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|end|>
{% else %}<|{{ message.role }}|>
{{ message.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

THOUGHT = "<think>\nTwo and two make four.\n</think>\n\n4"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "population"]}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model) -> str:
    """A 2-layer random Qwen3 with the default tokenizer and a template that thinks."""
    checkpoint = build_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", default_model, seed=4)
    return str(with_chat_template(checkpoint, tmp_path_factory.mktemp("tiny-qwen3-thinking"), QWEN3_STYLE_TEMPLATE))


@pytest.fixture(scope="module")
def service_settings() -> dict:
    return {"router": RouterConfig(api_key=API_KEY)}


@pytest.fixture(scope="module")
def http(service):
    """An httpx client on the service, with the API key."""
    try:  # the HTTP client the installed openai package is built on
        import httpx2 as httpx
    except ImportError:
        import httpx

    with httpx.Client(base_url=service.http_url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture
def client(service):
    """The official ``openai`` client on the service, with the API key (no retries)."""
    import openai

    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def forced(text: str) -> dict:
    """Request fields that make the model write exactly ``text`` (then its end token)."""
    return {"guided_regex": re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")}


def _ask(content: str = "What is 2 + 2?") -> list[dict]:
    return [{"role": "user", "content": content}]


# -- chat completions --------------------------------------------------------------------


def test_the_thinking_lands_in_reasoning_content_and_the_answer_in_content(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=_ask(), max_tokens=120, extra_body=forced(THOUGHT))
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert (choice.message.reasoning_content, choice.message.content) == ("Two and two make four.", "4"), choice

    reasoning, content, reasons = "", "", []
    for chunk in client.chat.completions.create(model=model_name, messages=_ask(), max_tokens=120, stream=True,
                                                extra_body=forced(THOUGHT)):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            assert not (delta.get("reasoning_content") and delta.get("content")), f"one part a delta: {delta}"
            reasons += [c.finish_reason] if c.finish_reason else []
    assert (reasoning, content, reasons) == ("Two and two make four.", "4", ["stop"])


def test_an_answer_without_thinking_is_content_and_enable_thinking_reaches_the_template(client, http, model_name):
    r = client.chat.completions.create(model=model_name, messages=_ask(), max_tokens=40, extra_body=forced("4, plain"))
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (None, "4, plain")
    body = {"model": model_name, "messages": _ask(), "chat_template_kwargs": {"enable_thinking": False}}
    thinking, closed = http.post("/tokenize", json={**body, "chat_template_kwargs": {}}), http.post("/tokenize", json=body)
    assert closed.json()["count"] > thinking.json()["count"], "enable_thinking false adds the closed empty block"
    r = client.chat.completions.create(model=model_name, messages=_ask(), max_tokens=40,
                                       extra_body={**forced("4"), "chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "4" and r.usage.prompt_tokens == closed.json()["count"]
    bad = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.messages", bad.text


def test_tool_calls_are_read_after_the_thinking_streamed_and_not(client, model_name):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text = f"<think>\nI need the weather: <tool_call> is how.\n</think>\n\n{call}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    kwargs = dict(model=model_name, messages=_ask("Weather in Oslo?"), tools=tools, max_tokens=200,
                  extra_body=forced(text))
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.reasoning_content == "I need the weather: <tool_call> is how."
    [got] = whole.message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == ("get_weather", {"city": "Oslo"})
    reasoning, arguments, reasons = "", "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += c.delta.model_dump().get("reasoning_content") or ""
            arguments += "".join(t.function.arguments or "" for t in c.delta.tool_calls or ())
            reasons += [c.finish_reason] if c.finish_reason else []
    assert (reasoning, json.loads(arguments), reasons) == (whole.message.reasoning_content, {"city": "Oslo"},
                                                           ["tool_calls"])


def test_several_choices_each_stream_their_own_thinking(client, model_name):
    parts: dict[int, dict[str, str]] = {0: {}, 1: {}}
    for chunk in client.chat.completions.create(model=model_name, messages=_ask(), max_tokens=120, n=2, stream=True,
                                                extra_body=forced(THOUGHT)):
        for c in chunk.choices:
            for key, value in c.delta.model_dump().items():
                if key in ("reasoning_content", "content") and value:
                    parts[c.index][key] = parts[c.index].get(key, "") + value
    want = {"reasoning_content": "Two and two make four.", "content": "4"}
    assert parts == {0: want, 1: want}
    r = client.chat.completions.create(model=model_name, messages=_ask(), max_tokens=120, n=2,
                                       extra_body=forced(THOUGHT))
    assert [(c.message.reasoning_content, c.message.content) for c in r.choices] == [tuple(want.values())] * 2


# -- the Responses API -------------------------------------------------------------------


def test_a_response_is_created_retrieved_and_deleted(client, model_name):
    import openai

    r = client.responses.create(model=model_name, input="What is 2 + 2?", instructions="Think first.",
                                max_output_tokens=120, extra_body=forced(THOUGHT))
    assert r.status == "completed" and r.object == "response" and r.instructions == "Think first."
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two and two make four."
    assert message.type == "message" and r.output_text == "4"
    assert r.usage.output_tokens > 0 and r.usage.output_tokens_details.reasoning_tokens > 0
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)

    cut = client.responses.create(model=model_name, input="Hi", max_output_tokens=3, store=False)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(cut.id)


def test_a_streamed_response_sends_its_typed_events_and_the_whole_response_last(client, model_name):
    events = list(client.responses.create(model=model_name, input="What is 2 + 2?", max_output_tokens=120,
                                          stream=True, extra_body=forced(THOUGHT)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2, kinds
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert (reasoning, text) == ("Two and two make four.", "4") and final.output_text == "4"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert client.responses.retrieve(final.id).output_text == "4", "a streamed response is stored too"


def test_previous_response_id_continues_the_conversation(client, http, model_name):
    first = client.responses.create(model=model_name, input="My name is Ada.", max_output_tokens=40,
                                    extra_body=forced("Hello Ada."))
    assert first.output_text == "Hello Ada."
    second = client.responses.create(model=model_name, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=40, extra_body=forced("Ada."))
    third = client.responses.create(model=model_name, input="Sure?", previous_response_id=second.id,
                                    max_output_tokens=5)
    conversation = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
                    {"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": "Ada."},
                    {"role": "user", "content": "Sure?"}]
    counted = http.post("/tokenize", json={"model": model_name, "messages": conversation}).json()["count"]
    assert third.usage.input_tokens == counted, "the prompt is the whole conversation, as a chat sends it"
    assert third.previous_response_id == second.id


def test_function_tools_call_and_take_the_output_back(client, http, model_name):
    r = client.responses.create(model=model_name, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    named = client.responses.create(model=model_name, input="Weather?", tools=TOOLS, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"}, stream=True)
    events = list(named)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments and events[-1].response.output[0].arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)

    answer = client.responses.create(model=model_name, previous_response_id=r.id, tools=TOOLS, max_output_tokens=5,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "4C"}])
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    conversation = [{"role": "user", "content": "Weather in Oslo?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "4C"}]
    counted = http.post("/tokenize", json={"model": model_name, "messages": conversation, "tools": chat_tools})
    assert answer.usage.input_tokens == counted.json()["count"], counted.text


def test_a_json_schema_format_shapes_the_output_text(client, model_name):
    for seed in (0, 1):
        r = client.responses.create(model=model_name, input="A city, as JSON", max_output_tokens=80, temperature=1.0,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
                                    extra_body={"seed": seed})
        assert r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), CITY)


def test_bad_inputs_are_4xx_naming_the_field(client, model_name):
    import openai

    def param(status, **kwargs) -> str:
        error = openai.NotFoundError if status == 404 else openai.BadRequestError
        with pytest.raises(error) as e:
            client.responses.create(**{"model": model_name, "input": "hi", "max_output_tokens": 5, **kwargs})
        return e.value.body["param"]

    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]
    assert param(400, input=image) == "input.0.content.0.type"
    assert param(400, input=[{"type": "item_reference", "id": "x"}]) == "input.0.type"
    assert param(400, input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]) == \
        "input.0.arguments"
    assert param(400, tools=[{"type": "web_search"}]) == "tools.0.type"
    assert param(400, text={"format": {"type": "json_schema", "name": "x", "schema": {"properties": 3}}}) == \
        "text.format.schema"
    assert param(400, max_output_tokens=10**6) == "max_output_tokens"
    assert param(400, tools=TOOLS, tool_choice={"type": "function", "name": "nope"}) == "tool_choice.name"
    assert param(404, previous_response_id="resp_unknown") == "previous_response_id"
    assert param(404, model="no-such-model") == "model"


def test_the_responses_endpoints_need_the_api_key(client, http, model_name):
    stored = client.responses.create(model=model_name, input="Hi", max_output_tokens=2)
    calls = [("POST", "/v1/responses", {"model": model_name, "input": "Hi", "max_output_tokens": 2}),
             ("GET", f"/v1/responses/{stored.id}", None), ("DELETE", f"/v1/responses/{stored.id}", None)]
    for method, path, body in calls:
        for headers in ({"authorization": ""}, {"authorization": "Bearer wrong"}):
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
    assert client.responses.retrieve(stored.id).id == stored.id, "refused calls changed nothing"
