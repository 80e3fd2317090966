"""Several choices in one response (``n``, and a list of prompts): validation, the order
of the choices and their seeds, the response and chunk shapes, the usage, and the
``Fanout`` that starts a prompt's other choices once its first one streams."""

from __future__ import annotations

import asyncio
import json

from engine.wire.messages import StreamDelta
from router.fanout import Fanout
from router.openai_api import Accumulator, Envelope
from router.validation import MAX_N, MAX_PROMPTS, choices, prepare_chat, prepare_completions
from tests.unit.test_tool_validation import MODEL as TOOL_MODEL
from tests.unit.test_tool_validation import TOOLS, TemplateTokenizer
from tests.unit.test_validation import MODEL, FakeTokenizer, error_of

CHAT = [{"role": "user", "content": "hey"}]


def completions(**body):
    return prepare_completions({"prompt": "hi", **body}, MODEL, FakeTokenizer())


# -- validation ------------------------------------------------------------------------


def test_n_is_an_integer_from_1_to_16_on_both_endpoints():
    assert completions(n=MAX_N)[0].n == MAX_N and completions()[0].n == 1
    assert prepare_chat({"messages": CHAT, "n": 3}, MODEL, FakeTokenizer()).n == 3
    for bad in (0, -1, MAX_N + 1, 2.0, "2", True):
        e = error_of(completions, n=bad)
        assert (e.status, e.param) == (400, "n"), (bad, e.message)
        e = error_of(prepare_chat, {"messages": CHAT, "n": bad}, MODEL, FakeTokenizer())
        assert (e.status, e.param) == (400, "n"), (bad, e.message)


def test_best_of_is_refused_unless_it_equals_n():
    assert completions(n=3, best_of=3)[0].n == 3
    e = error_of(completions, n=2, best_of=4)
    assert (e.status, e.param) == (400, "best_of") and "must equal n (2)" in e.message, e.message


def test_prompts_times_n_over_the_limit_is_a_400_naming_n():
    assert len(completions(prompt=["a"] * (MAX_PROMPTS // 4), n=4)) == MAX_PROMPTS // 4
    e = error_of(completions, prompt=["a"] * (MAX_PROMPTS // 4 + 1), n=4)
    assert (e.status, e.param) == (400, "n") and str(MAX_PROMPTS) in e.message, e.message


def test_n_with_tools_is_a_400_naming_n_but_tool_choice_none_is_plain_content():
    body = {"messages": CHAT, "tools": TOOLS, "n": 2}
    e = error_of(prepare_chat, body, TOOL_MODEL, TemplateTokenizer())
    assert (e.status, e.param) == (400, "n") and "tools" in e.message, e.message
    assert prepare_chat({**body, "tool_choice": "none"}, TOOL_MODEL, TemplateTokenizer()).n == 2


def test_streams_take_n():
    prepared = completions(n=2, stream=True, stream_options={"include_usage": True})[0]
    assert (prepared.n, prepared.stream, prepared.include_usage) == (2, True, True)


# -- choices: order, seeds, leaders ----------------------------------------------------


def test_choices_run_prompt_major_with_seeds_s_plus_i_and_their_prompts_first_as_leader():
    every = choices(completions(prompt=["ab", "c"], n=3, seed=10))
    assert [c.prepared.prompt_token_ids for c in every] == [[97, 98]] * 3 + [[99]] * 3, "index = prompt * n + i"
    assert [c.prepared.params.seed for c in every] == [10, 11, 12] * 2, "vLLM's rule: choice i samples with s + i"
    assert [c.leader for c in every] == [0, 0, 0, 3, 3, 3]
    assert all(c.prepared.n == 1 for c in every)


def test_choices_without_a_seed_stay_unseeded_and_n_1_is_the_request_itself():
    assert [c.prepared.params.seed for c in choices(completions(n=2))] == [None, None]
    (only,) = choices(completions())
    assert only.prepared == completions()[0] and only.leader == 0


# -- response shapes -------------------------------------------------------------------


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _acc(text: str, prompt_tokens: int, cached: int = 0, reason: str = "length") -> Accumulator:
    acc = Accumulator(CharTokenizer())
    acc.add(StreamDelta("r", [ord(c) for c in text], text, True, reason, num_prompt_tokens=prompt_tokens,
                        num_output_tokens=len(text), num_cached_tokens=cached))
    return acc


ENV = Envelope("x-1", "m", 7)


def test_a_response_of_n_choices_indexes_them_and_counts_each_prompt_once():
    # 2 prompts (5 and 3 tokens) × n = 2: the second choice of each prompt hit the cache.
    accs = [_acc("ab", 5), _acc("c", 5, cached=4), _acc("de", 3), _acc("f", 3, cached=2)]
    for chat in (False, True):
        out = ENV.choices(accs, chat, n=2)
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        texts = [c["message"]["content"] if chat else c["text"] for c in out["choices"]]
        assert texts == ["ab", "c", "de", "f"]
        assert out["object"] == ("chat.completion" if chat else "text_completion")
        assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14,
                                "prompt_tokens_details": {"cached_tokens": 0}}, out["usage"]
    chat_choice = ENV.choices(accs[:1], True, n=1)["choices"][0]
    assert chat_choice["message"] == {"role": "assistant", "content": "ab"} and chat_choice["finish_reason"] == "length"


def test_usage_of_one_choice_a_prompt_is_the_sum():
    accs = [_acc("ab", 5, cached=1), _acc("c", 3)]
    assert ENV.choices_usage_chunk(accs, False, n=1)["usage"]["prompt_tokens"] == 8
    assert ENV.choices_usage_chunk(accs, True, n=1)["object"] == "chat.completion.chunk"


def test_chunks_carry_their_choice_index():
    chunk = ENV.chat_chunk({"role": "assistant", "content": ""}, None, None, index=2)
    assert chunk["choices"] == [{"index": 2, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    chunk = ENV.completion_chunk("hi", None, 0, "stop", index=3)
    assert chunk["choices"][0]["index"] == 3 and chunk["choices"][0]["text"] == "hi"
    # The lean single-choice path still writes index 0, as the general builder does.
    assert json.loads(ENV.chat_sse("hi", None)[6:]) == ENV.chat_chunk({"content": "hi"}, None, None)


# -- Fanout: a prompt's other choices wait for its first one ---------------------------


def _run(name: str, n: int, log: list[str], after: asyncio.Event | None = None):
    async def run():
        if after is not None:
            await after.wait()
        log.append(f"{name} starts")
        for k in range(n):
            await asyncio.sleep(0)
            log.append(f"{name}{k}")
            yield StreamDelta(name, [k], f"{name}{k}", k == n - 1)

    return run()


def test_followers_start_only_after_their_leaders_first_delta():
    async def main():
        log: list[str] = []
        firsts = [asyncio.Event(), asyncio.Event()]
        fan = Fanout([_run("a", 3, log), _run("b", 2, log, after=firsts[0])], firsts)
        got = []
        while (item := await fan.next()) is not None:
            got.append(item)
        await fan.close()
        return log, got

    log, got = asyncio.run(main())
    assert log.index("b starts") > log.index("a0"), log
    assert sorted(d.text for _, d in got) == ["a0", "a1", "a2", "b0", "b1"]


def test_followers_still_run_when_their_leader_ends_without_a_delta():
    async def empty():
        return
        yield  # an async generator that yields nothing

    async def main():
        log: list[str] = []
        firsts = [asyncio.Event(), asyncio.Event()]
        fan = Fanout([empty(), _run("b", 1, log, after=firsts[0])], firsts)
        got = []
        while (item := await asyncio.wait_for(fan.next(), 5)) is not None:
            got.append(item[1].text)
        await fan.close()
        return got

    assert asyncio.run(main()) == ["b0"]
