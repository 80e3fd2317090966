"""The streaming hot path's SSE chunks equal the general builders' output byte for byte."""

from __future__ import annotations

import pytest

from router.openai_api import Accumulator, Envelope, sse

TEXTS = ["", " hello", 'q"uo\\te\n\t', "caf\u00e9 \u6f22\u5b57", "\ud800 lone surrogate", "\x00\x1f"]
REASONS = [None, "length", "stop", "abort"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", REASONS)
def test_fast_completion_chunk_equals_the_general_one(text, reason):
    env = Envelope("cmpl-0123", "tandem-tiny-llama", 1_700_000_000)
    assert env.completion_sse(text, reason) == sse(env.completion_chunk(text, None, 0, reason))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", REASONS)
def test_fast_chat_chunk_equals_the_general_one(text, reason):
    env = Envelope("chatcmpl-0123", 'model "quoted"', 1_700_000_000)
    content = {"content": text} if text else {}
    assert env.chat_sse(text, reason) == sse(env.chat_chunk(content, None, reason))


def test_accumulator_counts_text_without_joining_it():
    from engine.messages import StreamDelta

    acc = Accumulator(tokenizer=None)
    for i, piece in enumerate(["ab", "", "c\u00e9", "d"]):
        acc.add(StreamDelta("r", [i], piece, False, num_prompt_tokens=3, num_output_tokens=i + 1))
    assert acc.text == "abc\u00e9d" and acc.text_len == len(acc.text)
    assert acc.completion_tokens == 4 and acc.prompt_tokens == 3
