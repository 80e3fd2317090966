"""The Responses API without a service (``router.responses``, ``router.response_objects``,
``router.response_store``): a request as the chat it runs as, its 4xx naming the Responses
API's fields, the stored responses' bound, and the typed events of a stream, checked
against the official ``openai`` client's types."""

from __future__ import annotations

import json

import pytest
import tokenizers
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine.tokenizer import Tokenizer
from engine.wire.messages import StreamDelta
from router.chat_output import MessageStream, read_message
from router.errors import ApiError
from router.openai_api import Accumulator
from router.reasoning import REASONING_PARSERS, ReasoningPlan
from router.response_objects import ResponseEvents, ResponseHead, whole_response
from router.response_store import ResponseStore, StoredResponse
from router.responses import output_history, prepare_response
from router.validation import ServedModel
from tests.helpers import TOOL_CHAT_TEMPLATE

MODEL = ServedModel("tandem-tiny-llama", max_model_len=4096, vocab_size=1000, block_size=16, max_kv_blocks=1000,
                    reasoning=REASONING_PARSERS["qwen3"])
TOOLS = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
EVENT = TypeAdapter(ResponseStreamEvent)


class TemplateTokenizer:
    """One token per character; the chat template rendered by the engine's tokenizer, the
    messages it got kept."""

    def __init__(self) -> None:
        self.chat_template = TOOL_CHAT_TEMPLATE
        self._renderer = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=TOOL_CHAT_TEMPLATE)
        self.messages: list[dict] = []

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        self.messages = messages
        return self._renderer.apply_chat_template(messages, add_generation_prompt, **extra)


def prepare(body: dict, store: ResponseStore | None = None, tok: TemplateTokenizer | None = None):
    return prepare_response(store or ResponseStore(8), {"model": MODEL.name, **body}, MODEL,
                            tok or TemplateTokenizer())


def test_instructions_and_text_input_become_a_system_and_a_user_message():
    tok = TemplateTokenizer()
    req = prepare({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5}, tok=tok)
    assert tok.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (req.prepared.params.max_tokens, req.prepared.params.temperature) == (7, 0.5)
    assert req.history == ({"role": "user", "content": "Hi"},), "the instructions are not carried over"
    assert req.fields["instructions"] == "Be brief." and req.fields["text"] == {"format": {"type": "text"}}


def test_input_items_become_the_chats_messages_calls_joining_their_assistant_turn():
    tok = TemplateTokenizer()
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "now?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4C"},
    ]
    req = prepare({"input": items, "tools": TOOLS}, tok=tok)
    assert tok.messages == [
        {"role": "user", "content": "Weather now?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "4C", "tool_call_id": "c1"},
    ]
    assert req.prepared.tools.mode == "auto" and req.prepared.reasoning == ReasoningPlan(REASONING_PARSERS["qwen3"])


def test_previous_response_id_puts_the_stored_conversation_before_the_input():
    store, tok = ResponseStore(8), TemplateTokenizer()
    first = prepare({"input": "My name is Ada.", "instructions": "Be kind."}, store)
    output = [{"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
               "content": [{"type": "output_text", "text": "Hello Ada.", "annotations": []}]}]
    store.put("resp_1", StoredResponse({"id": "resp_1"}, output_history(first, output)))
    prepare({"input": "Who am I?", "previous_response_id": "resp_1", "instructions": "Be brief."}, store, tok)
    assert tok.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."},
                            {"role": "assistant", "content": "Hello Ada."}, {"role": "user", "content": "Who am I?"}]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type"),
    ({"input": [{"type": "web_search_call"}]}, 400, "input.0.type"),
    ({"input": ["text"]}, 400, "input.0"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input.0.role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "1"}]}, 400, "input.0.arguments"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call_output", "call_id": "c",
                                                   "output": "\ud800"}]}, 400, "input.1.output"),
    ({"input": "\ud800"}, 400, "input"),
    ({"input": "hi", "instructions": "\ud800"}, 400, "instructions"),
    ({"input": "hi", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, 400, "tools.0.type"),
    ({"input": "hi", "tools": TOOLS * 2}, 400, "tools.1.name"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
    ({"input": "hi", "tool_choice": {"type": "mcp"}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}, "guided_regex": "a"}, 400, "guided_regex"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "previous_response_id": "resp_gone"}, 404, "previous_response_id"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": "hi", "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs.tools"),
])
def test_bad_requests_are_4xx_naming_the_responses_apis_field(body, status, param):
    with pytest.raises(ApiError) as e:
        prepare(body)
    assert (e.value.status, e.value.param) == (status, param), e.value.message
    assert param.split(".")[0] in e.value.message, e.value.message
    assert "messages" not in e.value.message and "max_tokens " not in e.value.message, e.value.message


def test_a_structured_outputs_field_is_named_as_the_request_gave_it():
    schema = {"type": "object"}
    req = prepare({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
    assert req.prepared.structured_field == "text.format.schema" and req.prepared.reasoning.thinking is False
    named = prepare({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named.prepared.structured_field == "tools.0.parameters"


def test_the_store_keeps_the_latest_and_reading_one_makes_it_the_latest():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, ()))
    assert store.get("a") is not None  # now b is the least recent
    store.put("c", StoredResponse({"id": "c"}, ()))
    assert (store.get("b"), len(store)) == (None, 2) and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    none = ResponseStore(0)
    none.put("x", StoredResponse({}, ()))
    assert none.get("x") is None
    with pytest.raises(ValueError, match="max_stored_responses must be >= 0"):
        ResponseStore(-1)


# -- the response, whole and streamed ---------------------------------------------------

HEAD_FIELDS = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _acc(text: str, reason: str) -> Accumulator:
    acc = Accumulator(tokenizer=None)
    acc.add(StreamDelta("r", [1, 2, 3], text, True, reason, num_prompt_tokens=5, num_output_tokens=3))
    return acc


def _streamed(text: str, reason: str, pieces: int = 5, tools=None) -> tuple[list, dict]:
    """The events of ``text`` streamed in ``pieces``-character deltas, each checked as
    the openai client's event type, and the final response."""
    plan = ReasoningPlan(REASONING_PARSERS["qwen3"])
    events = ResponseEvents(ResponseHead("resp_1", 0, "m", HEAD_FIELDS), MessageStream(plan, tools))
    raw = events.opening() + "".join(events.feed(text[i:i + pieces]) for i in range(0, len(text), pieces))
    last, response = events.finish(reason, _acc(text, reason), len)
    parsed = []
    for block in (raw + last).strip().split("\n\n"):
        name, data = block.split("\n")
        event = EVENT.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        parsed.append(event)
    return parsed, response


def _auto_tools():
    from router.tool_calls import ToolPlan
    from router.tool_parsers import HermesParser

    return ToolPlan("auto", parser=HermesParser(), tools=frozenset({"get_weather"}))


def test_a_stream_sends_each_item_as_it_grows_and_ends_with_the_whole_response():
    text = f"<think>\nweather first\n</think>\n\nChecking. {CALL}"
    events, response = _streamed(text, "stop", tools=_auto_tools())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "weather first"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Checking. "
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == '{"city": "Oslo"}'
    final = Response.model_validate(response)
    assert final.output_text == "Checking. " and final.usage.output_tokens_details.reasoning_tokens == 13
    whole = whole_response(ResponseHead("resp_1", 0, "m", HEAD_FIELDS),
                           read_message(text, "stop", _auto_tools(), ReasoningPlan(REASONING_PARSERS["qwen3"])),
                           _acc(text, "stop"), len)

    def shape(items):
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert shape(whole["output"]) == shape(response["output"]), "the whole response's items are the streamed ones"


def test_a_stream_cut_by_max_output_tokens_is_incomplete_and_an_empty_one_is_an_empty_message():
    events, response = _streamed("<think>still thinking", "length")
    assert events[-1].type == "response.incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["type"], i["status"]) for i in response["output"]] == [("reasoning", "incomplete")]
    events, response = _streamed("", "stop")
    assert [(i["type"], i["content"][0]["text"]) for i in response["output"]] == [("message", "")]
    assert Response.model_validate(response).output_text == ""


def test_a_failed_stream_ends_with_the_error_and_the_failed_response():
    events = ResponseEvents(ResponseHead("resp_1", 0, "m", HEAD_FIELDS), MessageStream(None, None))
    raw = events.opening() + events.feed("partial") + events.failed(ApiError(500, "worker died", type="server_error"))
    kinds = [json.loads(b.split("\n")[1].removeprefix("data: "))["type"] for b in raw.strip().split("\n\n")]
    assert kinds[-2:] == ["error", "response.failed"], kinds
