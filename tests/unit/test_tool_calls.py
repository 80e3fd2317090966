"""Tool-call parsing, streaming and the schemas that enforce required and named choices
(``router.tool_calls``): pure, on hand-written model outputs, well-formed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_calls import (
    EMPTY_PARAMETERS,
    HermesParser,
    Llama3JsonParser,
    ToolPlan,
    ToolStream,
    parse_required,
    parser_for_template,
    required_schema,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = [
    {"name": "get_weather", "parameters": WEATHER},
    {"name": "get_time", "parameters": EMPTY_PARAMETERS},
]


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def assert_parses(parser, text: str, content: str | None, calls: list[tuple[str, dict]]) -> None:
    parsed = parser.parse(text)
    assert (parsed.content, calls_of(parsed)) == (content, calls), f"{parser.name} read {text!r} as {parsed}"


# -- Hermes / Qwen2.5 ------------------------------------------------------------


@pytest.mark.parametrize(
    "text,content,calls",
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         None, [("get_weather", {"city": "Paris"})]),
        ('Let me look. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
         "Let me look. ", [("get_time", {})]),
        ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
         '{"y": [1, {"z": "</tool"}]}}</tool_call>', None, [("a", {"x": 1}), ("b", {"y": [1, {"z": "</tool"}]})]),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and done', " and done", [("a", {})]),
        ('<tool_call>{"name": "a", "arguments": {"k": "\u00e9"}}', None, [("a", {"k": "\u00e9"})]),  # cut before </tool_call>
        ('<tool_call>{"name": "a", "parameters": {"k": 2}}</tool_call>', None, [("a", {"k": 2})]),
    ],
)
def test_hermes_finds_each_call_and_keeps_the_text_before_as_content(text, content, calls):
    assert_parses(HermesParser(), text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "",
        "<tool_call>",
        "<tool_call></tool_call>",
        '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>',  # a brace short
        '<tool_call>{"name": "a"}</tool_call>',  # no arguments
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": "{}"}</tool_call>',  # arguments as text
        '<tool_call>["a", {}]</tool_call>',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>',  # one bad: all content
        "<tool_call" + '{"name": "a", "arguments": {}}',
    ],
)
def test_hermes_output_that_does_not_parse_stays_content(text):
    assert_parses(HermesParser(), text, text, [])


# -- Llama 3 JSON ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text,content,calls",
    [
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
        ('  \n{"name": "a", "parameters": {}}  ', None, [("a", {})]),
        ('<|python_tag|>{"name": "a", "parameters": {"n": 1}}', None, [("a", {"n": 1})]),
        ('Checking.<|python_tag|>{"name": "a", "parameters": {}}', "Checking.", [("a", {})]),
        ('{"name": "a", "parameters": {"s": ";"}}; {"name": "b", "arguments": {"t": "}"}}',
         None, [("a", {"s": ";"}), ("b", {"t": "}"})]),
        ('{"name": "a", "parameters": {}};{"name": "b", "parameters": {}};', None, [("a", {}), ("b", {})]),
    ],
)
def test_llama3_json_finds_calls_at_the_start_or_after_the_python_tag(text, content, calls):
    assert_parses(Llama3JsonParser(), text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        'The call would be {"name": "a", "parameters": {}}',  # a call mid-text is prose
        '{"name": "a", "parameters": {}',
        '{"name": "a", "parameters": {}} and more',
        '{"name": "a", "parameters": {}}; not json',
        '{"city": "Paris"}',  # JSON, not a call
        '{"name": "a", "parameters": [1]}',
        "<|python_tag|>print('hi')",
        "{",
    ],
)
def test_llama3_json_output_that_does_not_parse_stays_content(text):
    assert_parses(Llama3JsonParser(), text, text, [])


def test_the_chat_template_picks_the_parser():
    assert isinstance(parser_for_template("{{ '<|start_header_id|>' }}{% if tools %}{% endif %}"), Llama3JsonParser)
    assert isinstance(parser_for_template("... <|python_tag|> ..."), Llama3JsonParser)
    assert isinstance(parser_for_template("{{ '<tool_call>' }}"), HermesParser)
    assert isinstance(parser_for_template(None), HermesParser), "Hermes is the format most templates teach"


# -- required and named ----------------------------------------------------------


def test_required_schema_lets_through_calls_to_the_tools_only():
    schema = required_schema(FUNCTIONS, parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time"}], [{"name": "get_time", "parameters": {}, "extra": 1}], {"name": "get_time"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_without_parallel_calls_takes_one_call():
    schema = required_schema(FUNCTIONS, parallel=False)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)


def test_required_schema_lifts_each_tools_defs_to_the_top_and_refuses_clashes():
    item = {"$defs": {"Unit": {"enum": ["C", "F"]}}, "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}
    schema = required_schema([{"name": "t", "parameters": item}], parallel=True)
    assert schema["$defs"] == {"Unit": {"enum": ["C", "F"]}} and "$defs" in item, "the tool's own schema is untouched"
    jsonschema.validate([{"name": "t", "parameters": {"unit": "C"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "t", "parameters": {"unit": "K"}}], schema)
    other = {"$defs": {"Unit": {"enum": ["K"]}}, "type": "object"}
    with pytest.raises(ValueError, match=r"\$defs.Unit"):
        required_schema([{"name": "t", "parameters": item}, {"name": "u", "parameters": other}], parallel=True)


def test_xgrammar_compiles_the_required_schema():
    from engine.grammar import problem

    spec = json.dumps(required_schema(FUNCTIONS, parallel=False))
    assert problem("json", spec) is None


def test_required_output_becomes_calls_or_content_when_cut_short():
    parsed = parse_required('[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
                            '{"name": "get_time", "parameters": {}}]')
    assert calls_of(parsed) == [("get_weather", {"city": "Rome"}), ("get_time", {})] and parsed.content is None
    for text in ('[{"name": "get_weather", "parameters": {"ci', "[]", '{"name": "a", "parameters": {}}'):
        assert parse_required(text).calls == [] and parse_required(text).content == text


def test_plans_read_outputs_and_name_the_finish_reason():
    named = ToolPlan("named", name="get_weather")
    parsed = named.parse('{"city": "Rome"}')
    assert calls_of(parsed) == [("get_weather", {"city": "Rome"})] and parsed.content is None
    assert named.finish_reason(parsed, "stop") == "stop", "a named choice ends as OpenAI's: stop"
    assert re.fullmatch(r"call_[0-9a-f]{24}", parsed.calls[0].id)

    auto = ToolPlan("auto", parser=HermesParser(), parallel=False)
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    parsed = auto.parse(two)
    assert calls_of(parsed) == [("a", {})], "without parallel calls only the first is kept"
    assert auto.finish_reason(parsed, "stop") == "tool_calls"
    assert auto.finish_reason(parsed, "length") == "length"
    assert auto.finish_reason(auto.parse("plain"), "stop") == "stop"


# -- streaming -------------------------------------------------------------------


def stream(plan: ToolPlan, pieces: list[str]) -> tuple[list[dict], object]:
    s = ToolStream(plan)
    deltas = [d for piece in pieces for d in s.feed(piece)]
    rest, parsed = s.finish()
    return deltas + rest, parsed


def content_of(deltas: list[dict]) -> str:
    return "".join(d.get("content", "") for d in deltas)


def test_a_stream_sends_content_until_a_call_begins_then_the_call_whole():
    pieces = ["Let me", " look. <", "tool_", 'call>{"name": "get_time",', ' "arguments": {}}</tool_call>']
    s = ToolStream(ToolPlan("auto", parser=HermesParser()))
    sent = [s.feed(p) for p in pieces]
    assert sent[:2] == [[{"content": "Let me"}], [{"content": " look. "}]], "a possible '<tool_call>' waits"
    assert sent[2:] == [[], [], []], "nothing of a call goes out before the output is complete"
    rest, parsed = s.finish()
    assert rest == [{"tool_calls": [{"index": 0, **parsed.calls[0].as_dict()}]}]
    assert calls_of(parsed) == [("get_time", {})]


def test_a_stream_releases_held_back_text_that_was_no_call():
    deltas, parsed = stream(ToolPlan("auto", parser=HermesParser()), ["a <tool", "kit> b", " <tool_call>{bad"])
    assert content_of(deltas) == "a <toolkit> b <tool_call>{bad" and parsed.calls == []
    assert all("tool_calls" not in d for d in deltas)


@pytest.mark.parametrize("pieces", [['{"name": "a", ', '"parameters": {}}'], [" ", ' {"name": "a", "parameters": {}}']])
def test_a_llama_stream_holds_leading_blanks_since_a_call_may_follow(pieces):
    deltas, parsed = stream(ToolPlan("auto", parser=Llama3JsonParser()), pieces)
    assert content_of(deltas) == "" and [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["a"]


def test_a_stream_ends_with_the_same_message_as_the_whole_output():
    text = 'Sure.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", ' \
           '"arguments": {}}</tool_call>'
    plan = ToolPlan("auto", parser=HermesParser())
    for size in (1, 3, 7, len(text)):
        deltas, _ = stream(plan, [text[i:i + size] for i in range(0, len(text), size)])
        whole = plan.parse(text)
        assert content_of(deltas) == whole.content, f"pieces of {size}"
        streamed = [(c["index"], c["function"]["name"], c["function"]["arguments"])
                    for d in deltas for c in d.get("tool_calls", [])]
        assert streamed == [(i, c.name, c.arguments) for i, c in enumerate(whole.calls)], f"pieces of {size}"


FRAGMENTS = ["Sure", " ", "\n", "<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "a", "arguments": {}}',
             '{"name": "b", "parameters": {"x": [1]}}', "; ", "<|python_tag|>", "{", "}", '"', "text"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8), cuts=st.lists(st.integers(0, 200), max_size=6),
       llama=st.booleans())
def test_any_output_streamed_in_any_pieces_says_what_the_whole_output_says(parts, cuts, llama):
    text = "".join(parts)
    plan = ToolPlan("auto", parser=Llama3JsonParser() if llama else HermesParser())
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas, parsed = stream(plan, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    whole = plan.parse(text)
    streamed_calls = [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])]
    assert streamed_calls == [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in parsed.calls]
    if not whole.calls:
        assert content_of(deltas) == text, "output with no calls is all content"
    elif whole.content is not None:
        assert content_of(deltas) == whole.content


def test_a_named_stream_sends_the_call_head_then_argument_fragments():
    deltas, parsed = stream(ToolPlan("named", name="get_weather"), ['{"ci', 'ty": "R', 'ome"}'])
    head = deltas[0]["tool_calls"][0]
    assert head["type"] == "function" and head["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert all(d["tool_calls"][0] == {"index": 0, "function": {"arguments": a}}
               for d, a in zip(deltas[1:], ['ty": "R', 'ome"}']))
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Rome"}'
    empty, _ = stream(ToolPlan("named", name="f"), [])
    assert empty[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}, "even an empty output names the call"


def test_a_required_stream_sends_the_calls_at_the_end():
    text = '[{"name": "get_time", "parameters": {}}]'
    deltas, parsed = stream(ToolPlan("required"), [text[:10], text[10:]])
    assert [d["tool_calls"][0]["function"] for d in deltas] == [{"name": "get_time", "arguments": "{}"}]
    cut, _ = stream(ToolPlan("required"), [text[:10]])
    assert cut == [{"content": text[:10]}], "an output cut short is content"
