"""Chat requests with tools: validation (400s naming the field), what the chat template
receives, the constraints of required and named choices, and the response message."""

from __future__ import annotations

import json

import pytest
import tokenizers

from engine.tokenizer import Tokenizer
from engine.wire.messages import StreamDelta
from router.errors import ApiError
from router.openai_api import Accumulator, Envelope
from router.tool_parsers import EMPTY_PARAMETERS, HermesParser, Llama3JsonParser, required_schema
from router.validation import ServedModel, prepare_chat
from tests.helpers import TOOL_CHAT_TEMPLATE

MODEL = ServedModel("tandem-tiny-llama", max_model_len=4096, vocab_size=1000, block_size=16, max_kv_blocks=1000)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]


class TemplateTokenizer:
    """One token per character; the chat template rendered by the engine's tokenizer."""

    def __init__(self, template: str = TOOL_CHAT_TEMPLATE) -> None:
        self.chat_template = template
        self._renderer = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=template)
        self.rendered = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        self.rendered = self._renderer.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.rendered


def chat(tok=None, **body):
    return prepare_chat({"messages": ASK, **body}, MODEL, tok or TemplateTokenizer())


def error_of(**body) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat(**body)
    return e.value


def test_the_template_gets_the_tools_and_earlier_calls_with_their_arguments_as_objects():
    tok = TemplateTokenizer()
    chat(tok, messages=HISTORY, tools=TOOLS)
    text = tok.rendered
    for tool in TOOLS:
        fn = {**tool["function"]}
        fn.setdefault("parameters", EMPTY_PARAMETERS)
        assert json.dumps({"type": "function", "function": fn}) in text, f"each tool as JSON in:\n{text}"
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text, text
    assert '<tool_response id="call_1">\n18C, sunny\n</tool_response>' in text, text


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt_and_the_output_plain():
    tok = TemplateTokenizer()
    req = chat(tok, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in tok.rendered and req.tools is None and req.params.structured_output is None
    plain = TemplateTokenizer()
    assert chat(plain).tools is None and plain.rendered == tok.rendered


def test_auto_is_the_default_with_tools_and_reads_the_output_with_the_templates_parser():
    req = chat(tools=TOOLS)
    assert req.tools.mode == "auto" and isinstance(req.tools.parser, HermesParser)
    assert req.params.structured_output is None, "auto leaves the output free"
    llama = TemplateTokenizer(TOOL_CHAT_TEMPLATE + "{{ '<|python_tag|>' if false }}")
    assert isinstance(chat(llama, tools=TOOLS).tools.parser, Llama3JsonParser)


def test_a_named_choice_constrains_the_output_to_the_functions_arguments():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    so = req.params.structured_output
    assert (so.kind, json.loads(so.spec)) == ("json", WEATHER)
    assert req.structured_field == "tools.1.function.parameters"
    assert (req.tools.mode, req.tools.name) == ("named", "get_weather")
    empty = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(empty.params.structured_output.spec) == EMPTY_PARAMETERS


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_choice_constrains_the_output_to_an_array_of_calls(parallel):
    req = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    functions = [{"name": "get_time", "parameters": EMPTY_PARAMETERS},
                 {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}]
    assert json.loads(req.params.structured_output.spec) == required_schema(functions, parallel)
    assert req.structured_field == "tools" and req.tools.mode == "required" and req.tools.parallel == parallel


def _assistant_calls(**function) -> list[dict]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", **function}}
    return [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]


NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a" * 65}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": "{}"}}]},
         "tools.0.function.parameters"),
        ({"tools": TOOLS + [TOOLS[0]]}, "tools.2.function.name"),
        ({"tools": "get_time"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": NAMED_NOPE}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"$defs": [1]}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
          "guided_regex": "a+"}, "tool_choice"),
        ({"messages": _assistant_calls(arguments="not json")}, "messages.1.tool_calls.0.function.arguments"),
        ({"messages": _assistant_calls(arguments="[1]")}, "messages.1.tool_calls.0.function.arguments"),
        ({"messages": _assistant_calls(arguments={"a": 1})}, "messages.1.tool_calls.0.function.arguments"),
        ({"messages": _assistant_calls(name="no spaces")}, "messages.1.tool_calls.0.function.name"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": _assistant_calls()[1]["tool_calls"]}]},
         "messages.0.tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
          "arguments": "{}"}}]}]}, "messages.0.tool_calls.0.id"),
        ({"messages": ASK + [{"role": "tool", "content": "18C"}]}, "messages.1.tool_call_id"),
        ({"messages": ASK + [{"role": "tool", "tool_call_id": "c"}]}, "messages.1.content"),
        ({"messages": ASK + [{"role": "tool", "tool_call_id": 7, "content": "x"}]}, "messages.1.tool_call_id"),
    ],
)
def test_malformed_tool_fields_are_400_naming_the_field(body, param):
    e = error_of(**body)
    assert (e.status, e.param) == (400, param), f"{body}: {e.param}: {e.message}"
    assert param.split(".")[0] in e.message, e.message


def test_auto_with_a_response_format_is_allowed_and_auto_without_tools_is_plain():
    req = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert req.tools.mode == "auto" and req.params.structured_output.kind == "json_object"
    assert chat(tool_choice="auto").tools is None


# -- the response --------------------------------------------------------------------


def _whole(req, text: str, reason: str = "stop") -> dict:
    acc = Accumulator(tokenizer=None)
    acc.add(StreamDelta("r", [1, 2], text, True, reason, num_prompt_tokens=3, num_output_tokens=2))
    return Envelope("chatcmpl-1", MODEL.name, 0).chat(acc, req.tools)["choices"][0]


def test_the_message_carries_the_calls_and_the_finish_reason_says_so():
    auto = chat(tools=TOOLS)
    choice = _whole(auto, 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    call = choice["message"]["tool_calls"][0]
    assert choice["message"]["content"] == "Checking. " and choice["finish_reason"] == "tool_calls"
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    plain = _whole(auto, "It is sunny.")
    assert plain["message"] == {"role": "assistant", "content": "It is sunny.", "tool_calls": []}
    assert plain["finish_reason"] == "stop"


def test_a_named_call_is_the_whole_output_and_finishes_with_stop():
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = _whole(named, '{"city": "Rome"}')
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    required = chat(tools=TOOLS, tool_choice="required")
    cut = _whole(required, '[{"name": "get_ti', "length")
    assert cut["message"]["tool_calls"] == [] and cut["finish_reason"] == "length"


def test_tokenize_counts_a_conversation_with_tools_as_the_chat_request_sends_it():
    from router.tokenization import tokenize

    tok = TemplateTokenizer()
    counted = tokenize({"messages": HISTORY, "tools": TOOLS}, MODEL, tok)["tokens"]
    assert counted == chat(tok, messages=HISTORY, tools=TOOLS).prompt_token_ids
    assert len(counted) > len(tokenize({"messages": HISTORY}, MODEL, tok)["tokens"]), "the tools are in the prompt"
    e = pytest.raises(ApiError, tokenize, {"messages": ASK, "tools": [{"type": "function"}]}, MODEL, tok).value
    assert e.param == "tools.0.function", e.message


class _Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return f"<{ids[0]}>"


def test_a_tool_requests_stream_sends_the_call_as_it_comes_and_every_deltas_logprobs():
    from router.stream_events import tool_events
    from router.tool_calls import ToolStream

    env, acc = Envelope("chatcmpl-1", MODEL.name, 0), Accumulator(_Decoder())
    stream = ToolStream(chat(tools=TOOLS).tools)
    texts = ["Hi <tool", '_call>{"name": "get_', 'time", "arguments": ', '{"zone": 2', "}}</tool_call>"]
    deltas = [StreamDelta("r", [i], text, i == len(texts) - 1, "stop" if i == len(texts) - 1 else None,
                          logprobs=[(i, -0.5, [])]) for i, text in enumerate(texts)]
    events = [json.loads(e.removeprefix("data: ")) for d in deltas for e in tool_events(env, acc, stream, d)]
    choices = [e["choices"][0] for e in events]
    assert [c["delta"] for c in choices[:3]] == [{"content": "Hi"}, {"content": " "}, {}], \
        "the blank before a call waits until the call begins; a delta with no part still carries its logprobs"
    assert [c["logprobs"]["content"][0]["token"] for c in choices[:5]] == [f"<{i}>" for i in range(5)]
    head, piece = choices[3]["delta"]["tool_calls"][0], choices[4]["delta"]["tool_calls"][0]
    assert (head["index"], head["function"]) == (0, {"name": "get_time", "arguments": '{"zone": '})
    assert piece == {"index": 0, "function": {"arguments": "2}"}}, "a number goes out once it ends"
    assert [c["finish_reason"] for c in choices] == [None] * 5 + ["tool_calls"]
