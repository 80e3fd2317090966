"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, and how ``bad_words`` are tokenized, on the
default model's real tokenizer."""

from __future__ import annotations

import pytest

from router.errors import ApiError
from router.tokenization import detokenize, tokenize
from router.validation import ServedModel, prepare_chat, prepare_completion


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def model(tokenizer):
    return ServedModel("tiny", max_model_len=32, vocab_size=tokenizer.backend().get_vocab_size(),
                       block_size=16, max_kv_blocks=4)


def error_of(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value


def test_a_prompt_is_counted_as_completions_would_encode_it(model, tokenizer):
    out = tokenize({"prompt": "Once upon a time"}, model, tokenizer)
    assert out["tokens"] == prepare_completion({"prompt": "Once upon a time"}, model, tokenizer).prompt_token_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 32, out
    bare = tokenize({"prompt": "Once upon a time", "add_special_tokens": False}, model, tokenizer)["tokens"]
    assert bare == tokenizer.encode("Once upon a time", add_special_tokens=False)


def test_messages_are_counted_through_the_chat_template_as_chat_would_send_them(model, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = tokenize({"messages": messages}, model, tokenizer)
    assert out["tokens"] == prepare_chat({"messages": messages}, model, tokenizer).prompt_token_ids
    no_prompt = tokenize({"messages": messages, "add_generation_prompt": False}, model, tokenizer)
    assert no_prompt["count"] < out["count"], "the assistant turn's opening adds tokens"


def test_continue_final_message_stops_right_after_the_last_message(model, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    out = tokenize({"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
                   model, tokenizer)
    assert tokenizer.decode(out["tokens"], skip_special_tokens=False).endswith("The answer is")


def test_a_prompt_over_the_context_is_counted_not_refused(model, tokenizer):
    out = tokenize({"prompt": "word " * 100}, model, tokenizer)
    assert out["count"] > out["max_model_len"]


def test_token_strs_on_request_and_detokenize_inverts_tokenize(model, tokenizer):
    text = "Hello, wörld"
    out = tokenize({"prompt": text, "add_special_tokens": False, "return_token_strs": True}, model, tokenizer)
    assert out["token_strs"] == [tokenizer.id_to_token(t) for t in out["tokens"]]
    assert detokenize({"tokens": out["tokens"]}, model, tokenizer) == {"prompt": text}
    assert detokenize({"tokens": []}, model, tokenizer) == {"prompt": ""}


@pytest.mark.parametrize(
    "fn, body, status, param",
    [
        (tokenize, {}, 400, "prompt"),
        (tokenize, {"prompt": 5}, 400, "prompt"),
        (tokenize, {"prompt": ["a"]}, 400, "prompt"),
        (tokenize, {"prompt": "\ud800"}, 400, "prompt"),
        (tokenize, {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        (tokenize, {"prompt": "a", "model": "gpt-4"}, 404, "model"),
        (tokenize, {"messages": []}, 400, "messages"),
        (tokenize, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        (tokenize, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
         400, "continue_final_message"),
        (detokenize, {}, 400, "tokens"),
        (detokenize, {"tokens": "abc"}, 400, "tokens"),
        (detokenize, {"tokens": [1, -1]}, 400, "tokens"),
        (detokenize, {"tokens": [1, 10**9]}, 400, "tokens"),
        (detokenize, {"tokens": [1.5]}, 400, "tokens.0"),
    ],
)
def test_bad_input_is_rejected_naming_the_field(model, tokenizer, fn, body, status, param):
    e = error_of(fn, body, model, tokenizer)
    assert (e.status, e.param) == (status, param), e.message
    assert param.split(".")[0] in e.message


def test_bad_words_are_banned_as_written_and_mid_text_as_vllm_tokenizes_them(model, tokenizer):
    def bad_words(*words):
        req = prepare_completion({"prompt": "x", "bad_words": list(words)}, model, tokenizer)
        return [list(w) for w in req.params.bad_words_token_ids]

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    # " upon a" spells the same number of tokens with another first one: both are banned.
    assert len(encode(" upon a")) == len(encode("upon a")) and encode(" upon a")[0] != encode("upon a")[0]
    assert bad_words("upon a") == [encode("upon a"), encode(" upon a")]
    assert bad_words("  upon a") == bad_words("upon a"), "leading spaces are dropped, as vLLM does"
    # " time" is one token where "time" is two: a different length, so only the bare spelling.
    assert len(encode(" time")) != len(encode("time")) and bad_words("time") == [encode("time")]
