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
    from engine.wire.messages import StreamDelta

    acc = Accumulator(tokenizer=None)
    for i, piece in enumerate(["ab", "", "c\u00e9", "d"]):
        acc.add(StreamDelta("r", [i], piece, False, num_prompt_tokens=3, num_output_tokens=i + 1))
    assert acc.text == "abc\u00e9d" and acc.text_len == len(acc.text)
    assert acc.completion_tokens == 4 and acc.prompt_tokens == 3


class _Tokens:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


PROMPT_LPS = [None, (7, -1.5, 2, [(9, -0.5), (7, -1.5)]), (8, -0.25, 1, [(8, -0.25), (9, -2.0)])]


def test_prompt_logprobs_take_vllms_shape_on_the_choice_and_on_a_chat():
    from engine.wire.messages import StreamDelta

    acc = Accumulator(_Tokens())
    acc.add(StreamDelta("r", [5], "x", True, "length", 3, 1, prompt_logprobs=PROMPT_LPS))
    want = [
        None,
        {7: {"logprob": -1.5, "rank": 2, "decoded_token": "<7>"}, 9: {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"}},
        {8: {"logprob": -0.25, "rank": 1, "decoded_token": "<8>"}, 9: {"logprob": -2.0, "rank": 2, "decoded_token": "<9>"}},
    ]
    assert acc.prompt_logprobs == want
    env = Envelope("cmpl-1", "m", 1)
    assert env.completion(acc)["choices"][0]["prompt_logprobs"] == want
    assert env.chat(acc)["prompt_logprobs"] == want and "prompt_logprobs" not in env.chat(acc)["choices"][0]
    assert "prompt_logprobs" not in env.completion(Accumulator(_Tokens()))["choices"][0], "only when asked"
    first = env.first_chunk(want, chat=False)
    assert first["choices"][0]["text"] == "" and first["choices"][0]["prompt_logprobs"] == want
    assert env.first_chunk(None, chat=False) is None, "a completion without them opens with its first text"
    assert env.first_chunk(want, chat=True)["prompt_logprobs"] == want


def test_echoed_prompt_logprobs_come_before_the_outputs_with_none_first():
    from engine.wire.messages import StreamDelta
    from router.openai_api import completion_logprobs, echo_logprobs

    prompt = [6, 7, 8]
    lps = echo_logprobs(prompt, PROMPT_LPS) + [(5, -0.1, [(5, -0.1)])]
    acc = Accumulator(_Tokens())
    acc.add(StreamDelta("r", [5], "<6><7><8><5>", True, "length", 3, 1, logprobs=lps))
    out = completion_logprobs(acc.logprobs, 0)
    assert out["tokens"] == ["<6>", "<7>", "<8>", "<5>"]
    assert out["token_logprobs"] == [None, -1.5, -0.25, -0.1]
    assert out["top_logprobs"] == [None, {"<9>": -0.5, "<7>": -1.5}, {"<8>": -0.25, "<9>": -2.0}, {"<5>": -0.1}]
    assert out["text_offset"] == [0, 3, 6, 9]


def test_a_logprob_of_minus_infinity_is_floored_so_the_json_stays_valid():
    """A token drawn where its constraints allowed none has logprob -inf (or NaN): JSON has
    neither, and a response carrying one was a 500 (or an SSE chunk no client parses)."""
    import json

    from engine.wire.messages import StreamDelta

    acc = Accumulator(_Tokens())
    inf, nan = float("-inf"), float("nan")
    lps = acc.add(StreamDelta("r", [0], "x", True, logprobs=[(0, inf, [(0, inf), (1, nan)])],
                              prompt_logprobs=[None, (5, inf, 1, [(5, nan)])]))
    env = Envelope("cmpl-0", "m", 0)
    for body in (env.completion(acc), env.completion_chunk("x", lps, 0, "stop"), env.chat_chunk({}, lps, "stop")):
        text = json.dumps(body, allow_nan=False)  # raises on -inf / NaN
        assert "-9999.0" in text, "floored where vLLM floors them"
