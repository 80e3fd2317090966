"""Reasoning output (``router.reasoning``, ``router.chat_output``): the thinking apart from
the answer, whole and streamed with the tags split at every position, outputs that do not
think and thinking cut short; the parser a template and the setting choose; and what a
chat request with it answers (``reasoning_content``, tools and structured output read
from the answer alone)."""

from __future__ import annotations

import json
import random

import pytest

from engine.wire.messages import StreamDelta
from router.chat_output import MessageStream, read_message
from router.openai_api import Accumulator, Envelope
from router.reasoning import REASONING_PARSERS, Part, ReasoningPlan, Split, reasoning_parser
from router.tool_calls import ToolPlan
from router.tool_parsers import HermesParser

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]
OPENS = ReasoningPlan(QWEN3)  # the output may open a block
THINKING = ReasoningPlan(QWEN3, thinking=True)  # the prompt opened it

# (plan, output, thinking, answer)
CASES = [
    (OPENS, "<think>\nLet me see.\n</think>\n\nThe answer is 4.", "Let me see.", "The answer is 4."),
    (OPENS, "  <think>a  b</think>c", "a  b", "c"),
    (OPENS, "<think></think>\n\nHi", None, "Hi"),
    (OPENS, "<think>\n\n</think>", None, None),
    (OPENS, "No thinking here.", None, "No thinking here."),
    (OPENS, "  plain, blanks kept\n", None, "  plain, blanks kept\n"),
    (OPENS, "Hi <think>not at the start</think>", None, "Hi <think>not at the start</think>"),
    (OPENS, "<thin", None, "<thin"),
    (OPENS, "", None, ""),
    (OPENS, "<think>\ncut short, still thinking\n\n", "cut short, still thinking", None),
    (OPENS, "<think>cut at the tag </thi", "cut at the tag </thi", None),
    (OPENS, "<think>a</think>b</think>c", "a", "b</think>c"),
    (OPENS, "<think>x < y and y </ z</think>  so x < z", "x < y and y </ z", "so x < z"),
    (THINKING, "Thinking first.\n</think>\n\nAnswer.", "Thinking first.", "Answer."),
    (THINKING, "<think>opened twice</think>ok", "opened twice", "ok"),
    (THINKING, "never closed", "never closed", None),
    (THINKING, "  <thi", "<thi", None),
    (THINKING, "</think>just the answer", None, "just the answer"),
    (ReasoningPlan(R1, thinking=True), "R1 thinks</think>Answer", "R1 thinks", "Answer"),
]


def streamed(plan: ReasoningPlan, pieces: list[str]) -> Split:
    """The pieces through a stream, each part's pieces joined (None for none)."""
    stream = plan.stream()
    parts = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
    assert all(text for _, text in parts), f"an empty piece went out: {parts}"
    reasoning = "".join(t for part, t in parts if part is Part.REASONING)
    content = "".join(t for part, t in parts if part is Part.CONTENT)
    return Split(reasoning or None, content or None)


def _as_streamed(split: Split) -> Split:
    return Split(split.reasoning, split.content or None)  # an empty answer sends no piece


@pytest.mark.parametrize(("plan", "text", "reasoning", "content"), CASES)
def test_the_whole_output_splits_into_thinking_and_answer(plan, text, reasoning, content):
    assert plan.split(text) == Split(reasoning, content), text


@pytest.mark.parametrize(("plan", "text", "reasoning", "content"), CASES)
def test_a_stream_cut_at_every_position_sends_what_the_whole_output_splits_into(plan, text, reasoning, content):
    want = _as_streamed(Split(reasoning, content))
    for cut in range(len(text) + 1):
        assert streamed(plan, [text[:cut], text[cut:]]) == want, f"{text!r} cut at {cut}"
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            assert streamed(plan, [text[:a], text[a:b], text[b:]]) == want, f"{text!r} cut at {a}, {b}"
    assert streamed(plan, list(text)) == want, f"{text!r} a character at a time"


def test_random_outputs_stream_as_they_split():
    rng = random.Random(5)
    alphabet = ["<think>", "</think>", "<", "</", "<th", "think", ">", " ", "\n", "a", "b", "</thi"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        for plan in (OPENS, THINKING):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert streamed(plan, pieces) == _as_streamed(plan.split(text)), (plan, pieces)


def test_thinking_goes_out_as_it_comes_holding_only_what_may_be_the_end_tag():
    stream = OPENS.stream()
    assert stream.feed("<thi") == [], "may be the start tag"
    assert stream.feed("nk>\nStep one") == [(Part.REASONING, "Step one")]
    assert stream.feed(" then\n") == [(Part.REASONING, " then")], "the blank may be the thinking's last"
    assert stream.feed("two </") == [(Part.REASONING, "\ntwo")]
    assert stream.feed("think>\n\n") == []
    assert stream.feed("Done") == [(Part.CONTENT, "Done")]
    assert stream.feed(" here") == [(Part.CONTENT, " here")]
    assert stream.finish() == []


def test_the_parser_comes_from_the_setting_and_auto_from_a_template_that_thinks():
    thinking = "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    assert reasoning_parser("auto", thinking) is QWEN3
    assert reasoning_parser("auto", "{{ messages }}") is None and reasoning_parser("auto", None) is None
    assert reasoning_parser("none", thinking) is None
    assert reasoning_parser("deepseek_r1", None) is R1
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, none, qwen3, deepseek_r1"):
        reasoning_parser("qwen", thinking)


def test_the_plan_starts_inside_the_thinking_when_the_prompt_opened_it_unless_a_grammar_shapes_the_output():
    assert ReasoningPlan.for_prompt(QWEN3, "<|im_start|>assistant\n", False) == OPENS
    assert ReasoningPlan.for_prompt(QWEN3, "<|im_start|>assistant\n<think>\n", False) == THINKING
    assert ReasoningPlan.for_prompt(QWEN3, "assistant\n<think>\n\n</think>\n\n", False) == OPENS, \
        "enable_thinking false: the prompt closed an empty block"
    assert ReasoningPlan.for_prompt(QWEN3, "assistant\n<think>\n", True) == OPENS
    assert ReasoningPlan.for_prompt(R1, "<｜Assistant｜>", False) == ReasoningPlan(R1, thinking=True)
    assert ReasoningPlan.for_prompt(R1, "<｜Assistant｜>", True) == ReasoningPlan(R1, thinking=False)
    assert ReasoningPlan.for_prompt(None, "<think>", False) is None


# -- the chat message ------------------------------------------------------------------

HERMES = ToolPlan("auto", parser=HermesParser(), tools=frozenset({"get_time"}))
CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call>'


def test_tool_calls_are_read_from_the_answer_alone():
    thought = f"<think>I could write {CALL} here</think>\n\nSure."
    message = read_message(thought, "stop", HERMES, OPENS)
    assert (message.reasoning, message.content, message.calls) == (f"I could write {CALL} here", "Sure.", [])
    assert message.finish_reason == "stop"
    called = read_message(f"<think>call it</think>\n{CALL}", "stop", HERMES, OPENS)
    assert called.reasoning == "call it" and called.content is None
    assert [(c.name, json.loads(c.arguments)) for c in called.calls] == [("get_time", {"zone": 2})]
    assert called.finish_reason == "tool_calls"


def _stream_message(plan, tools, pieces: list[str]) -> tuple[str, str, list]:
    stream = MessageStream(plan, tools)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    rest, parsed = stream.finish()
    deltas += rest
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    return reasoning, content, calls


def test_a_streamed_message_sends_thinking_then_the_answer_and_its_calls():
    text = f"<think>\nfirst the time\n</think>\n\nChecking. {CALL}"
    for cut in range(len(text) + 1):
        reasoning, content, calls = _stream_message(OPENS, HERMES, [text[:cut], text[cut:]])
        assert (reasoning, content) == ("first the time", "Checking. "), f"cut at {cut}"
        assert calls[0]["function"]["name"] == "get_time", f"cut at {cut}: {calls}"
        assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"zone": 2}


def _chat(text: str, reason: str = "stop", tools=None, plan=OPENS) -> dict:
    acc = Accumulator(tokenizer=None)
    acc.add(StreamDelta("r", [1, 2], text, True, reason, num_prompt_tokens=3, num_output_tokens=2))
    return Envelope("chatcmpl-1", "m", 0).chat(acc, tools, plan)["choices"][0]


def test_a_chat_completion_carries_reasoning_content_beside_its_content():
    choice = _chat("<think>2 + 2 is 4</think>\n\n4")
    assert choice["message"] == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 is 4"}
    plain = _chat("4")
    assert plain["message"] == {"role": "assistant", "content": "4", "reasoning_content": None}
    cut = _chat("<think>still going", "length")
    assert cut["message"]["content"] is None and cut["finish_reason"] == "length"
    assert _chat("4", plan=None)["message"] == {"role": "assistant", "content": "4"}, "no key without the parser"
    called = _chat(f"<think>t</think>{CALL}", tools=HERMES)
    assert called["message"]["reasoning_content"] == "t" and called["finish_reason"] == "tool_calls"


# -- chat requests ---------------------------------------------------------------------

# A Qwen3-style template: an assistant's reasoning_content as a <think> block, and with
# enable_thinking false an empty block closed in the prompt; OPENED's prompt opens one.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}<|end|>{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
)
OPENED = THINKING_TEMPLATE.replace("<|assistant|>{%", "<|assistant|><think>\n{%", 1)


class _Tokenizer:
    def __init__(self, template: str) -> None:
        import tokenizers

        from engine.tokenizer import Tokenizer

        self.chat_template = template
        self._renderer = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=template)
        self.rendered = ""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        self.rendered = self._renderer.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.rendered


def _prepare(template: str = THINKING_TEMPLATE, parser=QWEN3, **body):
    from router.validation import ServedModel, prepare_chat

    model = ServedModel("m", 4096, 1000, 16, 1000, reasoning=parser)
    tok = _Tokenizer(template)
    return prepare_chat({"messages": [{"role": "user", "content": "2 + 2?"}], **body}, model, tok), tok


def test_a_chat_request_reads_its_thinking_as_its_prompt_and_constraint_say():
    assert _prepare()[0].reasoning == OPENS
    assert _prepare(OPENED)[0].reasoning == THINKING, "the prompt opened the block"
    assert _prepare(parser=None)[0].reasoning is None, "no parser: the output is all content"
    constrained = _prepare(OPENED, response_format={"type": "json_object"})[0]
    assert constrained.reasoning == OPENS, "a grammar shapes the output from its first token"


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_its_own_variables():
    from router.errors import ApiError

    closed, tok = _prepare(chat_template_kwargs={"enable_thinking": False})
    assert tok.rendered.endswith("<|assistant|><think>\n\n</think>\n\n") and closed.reasoning == OPENS
    for name in ("messages", "tools", "add_generation_prompt", "bos_token", "raise_exception"):
        with pytest.raises(ApiError) as e:
            _prepare(chat_template_kwargs={name: 1})
        assert (e.value.status, e.value.param) == (400, f"chat_template_kwargs.{name}"), e.value.message


def test_an_assistants_reasoning_content_goes_back_to_the_template():
    from router.errors import ApiError

    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "t"},
               {"role": "user", "content": "c"}]
    _, tok = _prepare(messages=history)
    assert "<|assistant|><think>t</think>b<|end|>" in tok.rendered
    with pytest.raises(ApiError) as e:
        _prepare(messages=[{"role": "user", "content": "a", "reasoning_content": "t"}])
    assert e.value.param == "messages.0.reasoning_content", e.value.message
