"""Tool-call parsing, streaming and the schemas that enforce required and named choices
(``router.tool_parsers``, ``router.tool_calls``): pure, on hand-written model outputs, well-formed and not."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.json_rewriter import JsonRewriter
from router.tool_calls import ToolPlan, ToolStream
from router.tool_parsers import (
    EMPTY_PARAMETERS,
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
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


# -- Mistral / Mixtral, Phi-4-mini: a JSON array after a marker --------------------

MISTRAL_PARSER = JsonArrayParser("mistral", "[TOOL_CALLS]")
PHI4_PARSER = JsonArrayParser("phi4_mini_json", "functools[")


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (MISTRAL_PARSER, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         None, [("get_weather", {"city": "Paris"})]),
        (MISTRAL_PARSER, ' \n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, "]"]}}]',
         None, [("a", {}), ("b", {"x": [1, "]"]})]),  # the marker, a special token, skipped
        (MISTRAL_PARSER, 'Let me look.[TOOL_CALLS] [{"name": "a", "arguments": {}}]', "Let me look.", [("a", {})]),
        (MISTRAL_PARSER, '[TOOL_CALLS][{"name": "a", "parameters": {"k": 2}}] done', " done", [("a", {"k": 2})]),
        (PHI4_PARSER, 'functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
         None, [("get_weather", {"city": "Oslo"})]),
        (PHI4_PARSER, 'I will check. functools[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]',
         "I will check. ", [("a", {}), ("b", {})]),
        (PHI4_PARSER, '[{"name": "a", "arguments": {"n": 1}}]', None, [("a", {"n": 1})]),  # <|tool_call|> skipped
    ],
)
def test_json_array_parsers_find_the_calls_after_their_marker(parser, text, content, calls):
    assert_parses(parser, text, content, calls)


@pytest.mark.parametrize("parser", [MISTRAL_PARSER, PHI4_PARSER])
@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "[1] is a citation, [2] another",
        "[]",
        '[TOOL_CALLS]{"name": "a", "arguments": {}}',  # an object, not an array
        '[TOOL_CALLS][{"name": "a", "arguments": {}}',  # cut short
        'functools[{"name": "a", "arguments": {}}, 3]',
        '[{"name": "a", "arguments": [1]}]',
        "I import functools.partial here",
        "functools[",
    ],
)
def test_json_array_output_that_does_not_parse_stays_content(parser, text):
    assert_parses(parser, text, text, [])


def test_the_chat_template_picks_the_parser():
    assert isinstance(parser_for_template("{{ '<|start_header_id|>' }}{% if tools %}{% endif %}"), Llama3JsonParser)
    assert isinstance(parser_for_template("... <|python_tag|> ..."), Llama3JsonParser)
    assert isinstance(parser_for_template("{{ '<tool_call>' }}"), HermesParser)
    mistral = "{%- if tools %}{{- '[AVAILABLE_TOOLS] [' }}{%- endif %}{{- '[TOOL_CALLS] [' }}"
    assert parser_for_template(mistral).name == "mistral"
    phi4 = "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}"
    assert parser_for_template(phi4).name == "phi4_mini_json"
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

TOOLS = frozenset({"get_weather", "get_time", "a", "b"})
HERMES = ToolPlan("auto", parser=HermesParser(), tools=TOOLS)
LLAMA = ToolPlan("auto", parser=Llama3JsonParser(), tools=TOOLS)
MISTRAL = ToolPlan("auto", parser=MISTRAL_PARSER, tools=TOOLS)
PHI4 = ToolPlan("auto", parser=PHI4_PARSER, tools=TOOLS)
REQUIRED = ToolPlan("required", tools=TOOLS)


def assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """The message a client builds from the deltas: the content, each call (its head
    once, before its argument pieces) by index, and the calls' ids."""
    content, calls = "", {}
    for d in deltas:
        assert len(d) == 1, f"a delta carries content or one call's part: {d}"
        if "content" in d:
            content += d["content"]
            continue
        [part] = d["tool_calls"]
        i = part["index"]
        if "id" in part:
            assert i == len(calls) and part["type"] == "function", f"call {i}'s head, once and in order: {d}"
            calls[i] = {"id": part["id"], "name": part["function"]["name"], "arguments": ""}
        else:
            assert i in calls and list(part["function"]) == ["arguments"], f"a piece before its call's head: {d}"
        calls[i]["arguments"] += part["function"]["arguments"]
    return content or None, [(c["name"], c["arguments"]) for c in calls.values()], [c["id"] for c in calls.values()]


def message(parsed) -> tuple[str | None, list[tuple[str, str]]]:
    """A parse's content (None for none, as an empty stream sends none) and calls."""
    return parsed.content or None, [(c.name, c.arguments) for c in parsed.calls]


def run_stream(plan: ToolPlan, pieces: list[str]) -> tuple[list[dict], list[dict], object]:
    """The deltas sent while the pieces came, those ``finish`` sent, and its message."""
    s = ToolStream(plan)
    before = [d for piece in pieces for d in s.feed(piece)]
    rest, parsed = s.finish()
    return before, rest, parsed


def stream(plan: ToolPlan, pieces: list[str]) -> tuple[list[dict], object]:
    before, rest, parsed = run_stream(plan, pieces)
    return before + rest, parsed


def splits(text: str, seed: int = 0, random_ones: int = 12) -> list[list[str]]:
    """The text whole, a character at a time, and cut at random places (fixed seed)."""
    rng, out = random.Random(seed), [[text], list(text)]
    for _ in range(random_ones):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def assert_streams_as_parsed(plan: ToolPlan, text: str) -> None:
    """In every split: the finish's message is what the deltas assemble to, and it is
    the whole output's parse whenever that finds calls (or when no call went out)."""
    whole = plan.parse(text)
    for pieces in splits(text):
        before, rest, parsed = run_stream(plan, pieces)
        content, calls, ids = assemble(before + rest)
        assert (content, calls) == message(parsed) and ids == [c.id for c in parsed.calls], \
            f"finish describes what was sent, in {pieces}"
        if whole.calls or not calls:
            assert (content, calls) == message(whole), f"{pieces} assembled to {(content, calls)}, not {whole}"
        else:  # a call went out, then the output did not parse: finish adds nothing
            assert rest == [] and not whole.calls and all(name in plan.tools for name, _ in calls), (pieces, rest)


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
NESTED = ('{"name": "a", "arguments": {"filter": {"and": [{"k": "v"}, {"n": -1.5e3}], "deep": {"x": {"y": '
          '[true, false, null]}}}, "empty": {}, "list": [], "n": 1E5, "zero": -0, "big": 12345678901234567890}}')
TRICKY = (r'{"name": "b", "arguments": {"q": "a } { \" ] [ \\ \n tab\t", "u": "\u00e9t\u00e9 '
          '\U0001F600 ' r'\ud83d\ude00 \u00fc", "slash": "\/", "k\"ey": "}}}"}}')
WELL_FORMED = [
    (HERMES, f"<tool_call>\n{CALL}\n</tool_call>"),
    (HERMES, f"<tool_call>{CALL}</tool_call>\n<tool_call>{NESTED}</tool_call>\n<tool_call>{TRICKY}</tool_call>"),
    (HERMES, f"Let me check. <tool_call>{CALL}</tool_call>"),
    (HERMES, f"\n\n<tool_call>{CALL}</tool_call>"),  # blanks alone before a call are no content
    (HERMES, f"<tool_call>{CALL}</tool_call> then <tool_call>{NESTED}</tool_call> and done"),
    (HERMES, '<tool_call>{"arguments": {"x": [1, 2]}, "name": "a"}</tool_call>'),  # the name last
    (HERMES, '<tool_call>{"name": "a", "parameters": {"x": "y"}}</tool_call>'),
    (HERMES, '<tool_call>{"name": "not_a_tool", "arguments": {"x": 1}}</tool_call>'),  # sent whole at the end
    (HERMES, f"<tool_call>{NESTED}"),  # cut before </tool_call>
    (HERMES, "No call, just text with <tools> and {braces}.\n"),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (LLAMA, 'Checking.<|python_tag|>{"name": "a", "parameters": {"s": ";{}"}}; '
            '{"name": "b", "parameters": {"t": "}"}}'),
    (LLAMA, '  \n{"name": "a", "parameters": {"deep": {"l": [[], [{}]]}, "s": "\\"x\\""}};  '),
    (LLAMA, 'The call would be {"name": "a", "parameters": {}}'),
    (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'),
    (REQUIRED, '[\n  {"name": "a", "parameters": {"x": "\\u00e9", "y": [1.0, 2e-3]}}\n]'),
    (MISTRAL, f"[TOOL_CALLS][{CALL}, {NESTED}]"),
    (MISTRAL, f" [{TRICKY}]"),
    (MISTRAL, f"Checking.[TOOL_CALLS] [ {CALL} ] and done"),
    (MISTRAL, "A list: [1, 2] and [TOOL_CALLS] too"),
    (PHI4, f"functools[{CALL}]"),
    (PHI4, f"Sure. functools[{NESTED},{TRICKY}]"),
    (PHI4, "functools.partial, not a call"),
]


@pytest.mark.parametrize("plan,text", WELL_FORMED)
def test_a_streamed_output_in_any_pieces_assembles_to_its_whole_parse(plan, text):
    assert_streams_as_parsed(plan, text)


@pytest.mark.parametrize("plan,text", [
    (HERMES, f"<tool_call>{NESTED}</tool_call>"),
    (HERMES, f"Sure. <tool_call>{TRICKY}</tool_call><tool_call>{CALL}</tool_call>"),
    (LLAMA, f"<|python_tag|>{NESTED.replace('arguments', 'parameters')}"),
    (REQUIRED, f'[{CALL.replace("arguments", "parameters")}, {NESTED.replace("arguments", "parameters")}]'),
    (MISTRAL, f"[TOOL_CALLS][{NESTED}]"),
    (PHI4, f"Sure. functools[{TRICKY}, {CALL}]"),
])
def test_a_call_streams_piece_by_piece_before_the_output_ends(plan, text):
    before, rest, parsed = run_stream(plan, list(text))
    _, calls, _ = assemble(before)
    assert calls == message(plan.parse(text))[1], "every call is out, whole, before finish"
    pieces = [d for d in before if "tool_calls" in d]
    assert len(pieces) > 10 * len(calls), f"{len(pieces)} deltas for {len(calls)} calls: the arguments did not stream"
    assert not any("tool_calls" in d for d in rest)


def test_a_call_goes_out_once_its_name_is_whole_and_its_arguments_begin():
    s = ToolStream(HERMES)
    assert s.feed("Let me look. <tool_") == [{"content": "Let me look."}], "blanks and a possible tag wait"
    assert s.feed('call>{"name": "get_wea') == [{"content": " "}], "the call has begun: the blank was content"
    assert s.feed('ther", "arguments": ') == [], "no head before the arguments begin"
    [head] = s.feed('{"ci')
    assert head["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{"}, "a key goes out whole"
    assert s.feed('ty":"Ro') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"city": "Ro'}}]}], \
        "the arguments as the parse writes them (': ' after a key)"
    assert s.feed("me") == [{"tool_calls": [{"index": 0, "function": {"arguments": "me"}}]}]
    assert s.feed('"}}</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}]
    rest, parsed = s.finish()
    assert rest == [] and message(parsed) == ("Let me look. ", [("get_weather", '{"city": "Rome"}')])
    assert parsed.calls[0].id == head["tool_calls"][0]["id"]


def test_a_number_goes_out_once_it_ends_and_a_name_not_among_the_tools_waits_for_the_end():
    s = ToolStream(LLAMA)
    assert [d["tool_calls"][0]["function"] for d in s.feed('{"name": "a", "parameters": {"n": 12')] \
           == [{"name": "a", "arguments": '{"n": '}], "12 may go on: it waits"
    assert s.feed("0,") == [{"tool_calls": [{"index": 0, "function": {"arguments": "120, "}}]}]
    assert s.feed('"m": 1}}; {"name": "nope", "parameters": {"k": 1') != []
    assert s.feed("}}") == [], "a call to a function not among the tools is not streamed"
    rest, parsed = s.finish()
    assert rest == [{"tool_calls": [{"index": 1, **parsed.calls[1].as_dict()}]}], "the parse still has it"
    assert message(parsed)[1] == [("a", '{"n": 120, "m": 1}'), ("nope", '{"k": 1}')]


MALFORMED = [
    (HERMES, '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>'),  # a brace short
    (HERMES, f"<tool_call>{CALL}</tool_call><tool_call>oops</tool_call>"),  # one bad block: all content
    (HERMES, f"Sure. <tool_call>{CALL[:-20]}"),  # cut short
    (HERMES, '<tool_call>{"name": "a", "arguments": {"x": 1, "x": 2}}</tool_call>'),  # a key twice
    (HERMES, '<tool_call>{"name": "a", "arguments": {"s": "\\q"}}</tool_call>'),  # a bad escape
    (HERMES, '<tool_call>{"name": "a", "arguments": {"s": "a</tool_call>b"}}</tool_call>'),
    (HERMES, '<tool_call>{"name": "a", "arguments": "{}"}</tool_call>'),  # arguments as text
    (HERMES, '<tool_call>{"name" "a", "arguments": {}}</tool_call>'),
    (HERMES, '<tool_call>{"name": "a", "name": "b", "arguments": {}}</tool_call>'),
    (LLAMA, '{"name": "a", "parameters": {}} and more'),
    (LLAMA, '{"name": "a", "parameters": {"x": [1, 2,]}}'),
    (MISTRAL, f"[TOOL_CALLS][{CALL}, oops]"),
    (MISTRAL, f"[{CALL[:-12]}"),
    (PHI4, f"functools[{CALL} {CALL}]"),
    (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "R'),
    (REQUIRED, '[{"name": "get_wea'),
]


@pytest.mark.parametrize("plan,text", MALFORMED)
def test_output_that_does_not_parse_is_content_unless_a_call_went_out(plan, text):
    assert plan.parse(text).calls == [], "the whole output, not streamed, is content"
    assert_streams_as_parsed(plan, text)


def test_once_a_call_went_out_a_bad_rest_ends_the_stream_with_the_message_as_sent():
    before, rest, parsed = run_stream(HERMES, list(f"Hi <tool_call>{CALL}</tool_call>\n<tool_call>{{oops}}"))
    assert rest == [], "nothing can take the call back: finish adds nothing"
    assert message(parsed) == ("Hi ", [("get_weather", '{"city": "Paris", "days": 3}')])
    assert HERMES.finish_reason(parsed, "stop") == "tool_calls", "the finish reason follows what was sent"
    before, rest, parsed = run_stream(REQUIRED, list('[{"name": "get_time", "parameters": {"zone": 1'))
    assert message(parsed) == (None, [("get_time", '{"zone": ')]), "cut short: the arguments as far as certain"
    assert REQUIRED.finish_reason(parsed, "length") == "length"


def test_a_stream_releases_held_back_text_that_was_no_call():
    deltas, parsed = stream(HERMES, ["a <tool", "kit> b", " <tool_call>{bad"])
    assert assemble(deltas)[:2] == ("a <toolkit> b <tool_call>{bad", []) and parsed.calls == []


@pytest.mark.parametrize("pieces", [['{"name": "a", ', '"parameters": {}}'], [" ", ' {"name": "a", "parameters": {}}']])
def test_a_llama_stream_holds_leading_blanks_since_a_call_may_follow(pieces):
    deltas, parsed = stream(LLAMA, pieces)
    assert assemble(deltas)[:2] == (None, [("a", "{}")])


def test_without_parallel_calls_only_the_first_streams():
    plan = ToolPlan("auto", parser=HermesParser(), parallel=False, tools=TOOLS)
    text = f"<tool_call>{CALL}</tool_call><tool_call>{NESTED}</tool_call>"
    assert_streams_as_parsed(plan, text)
    before, _, _ = run_stream(plan, list(text))
    assert {c["index"] for d in before for c in d.get("tool_calls", [])} == {0}


FRAGMENTS = ["Sure", " ", "\n", "<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "a", "arguments": {}}',
             '{"name": "b", "parameters": {"x": [1]}}', '{"name": "a", "arguments": {"s": "}\\"{"}}', "; ",
             "<|python_tag|>", "{", "}", '"', "text", ",", '{"name": "a", ', "[TOOL_CALLS]", "[", "]",
             "functools[", "[TOOL"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8), cuts=st.lists(st.integers(0, 200), max_size=6),
       plan=st.sampled_from([HERMES, LLAMA, MISTRAL, PHI4]))
def test_any_output_streamed_in_any_pieces_says_what_the_whole_output_says(parts, cuts, plan):
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    before, rest, parsed = run_stream(plan, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    sent, whole = assemble(before + rest), plan.parse(text)
    assert sent[:2] == message(parsed)
    if whole.calls or not sent[1]:
        assert sent[:2] == message(whole)
    else:
        assert rest == []


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=24,
)


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=5), ascii=st.booleans(),
       indent=st.sampled_from([None, 0, 1]), cuts=st.lists(st.integers(1, 400), max_size=20))
def test_the_rewriter_writes_what_json_dumps_writes_and_only_that_as_the_text_comes(value, ascii, indent, cuts):
    text = json.dumps(value, ensure_ascii=ascii, indent=indent)  # ascii: escapes, surrogate pairs too
    expected = json.dumps(json.loads(text), ensure_ascii=False)
    reader = JsonRewriter(0)
    for limit in sorted({*(c for c in cuts if c < len(text)), len(text)}):
        reader.read(text, limit)
        assert expected.startswith(reader.out), f"{reader.out!r} after {text[:limit]!r}"
    assert (reader.out, reader.end, reader.broken) == (expected, len(text), False)


@pytest.mark.parametrize("text", ['{"a": 1, "a": 2}', '{"a": 1,}', '[1 2]', '{"a" 1}', '{"a": tru}', '{"a": 01}',
                                  '{"a": "\x01"}', '{"a": "\\x"}', '{1: 2}', '{"a": [}', '{"a": 1]', "{,}"])
def test_the_rewriter_stops_at_text_that_cannot_be_json(text):
    reader = JsonRewriter(0)
    reader.read(text, len(text))
    assert reader.broken and reader.end is None, f"{text!r} read as {reader.out!r}"


def test_a_named_stream_sends_the_call_head_then_argument_fragments():
    deltas, parsed = stream(ToolPlan("named", name="get_weather"), ['{"ci', 'ty": "R', 'ome"}'])
    head = deltas[0]["tool_calls"][0]
    assert head["type"] == "function" and head["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert all(d["tool_calls"][0] == {"index": 0, "function": {"arguments": a}}
               for d, a in zip(deltas[1:], ['ty": "R', 'ome"}']))
    assert assemble(deltas)[1] == [("get_weather", '{"city": "Rome"}')]
    empty, _ = stream(ToolPlan("named", name="f"), [])
    assert empty[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}, \
        "even an empty output names the call"


def test_a_required_stream_is_calls_or_content_when_cut_short_before_a_call_went_out():
    text = '[{"name": "get_time", "parameters": {}}]'
    deltas, parsed = stream(REQUIRED, [text[:10], text[10:]])
    assert assemble(deltas)[:2] == (None, [("get_time", "{}")]) == message(parsed)
    cut, _ = stream(REQUIRED, [text[:10]])
    assert cut == [{"content": text[:10]}], "an output cut short is content"
