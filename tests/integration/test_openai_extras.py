"""vLLM's extras to the OpenAI API through the live service: the tokenizer endpoints,
``/version``, and the sampling controls (``logit_bias``, ``allowed_token_ids``,
``bad_words``) with the official ``openai`` client.

One service (1 prefill + 1 decode worker on the tiny random model) for the module, so
every request takes the disaggregated path: the prefill worker samples the first token
under the request's controls, the decode worker the rest. Every test ends with no KV
blocks in use anywhere.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    return {"prefill_workers": 1, "decode_workers": 1}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_model)


# -- the tokenizer endpoints -------------------------------------------------------------


def test_models_carry_max_model_len_and_tokenize_agrees_with_usage(client, http, model_name):
    (entry,) = client.models.list().data
    max_model_len = entry.model_extra["max_model_len"]
    assert isinstance(max_model_len, int) and max_model_len > 0, entry
    r = http.post("/tokenize", json={"model": model_name, "prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens"} and out["max_model_len"] == max_model_len, out
    usage = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=1).usage
    assert out["count"] == len(out["tokens"]) == usage.prompt_tokens
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    usage = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens, (chat, usage)


def test_detokenize_inverts_tokenize_and_version_answers(http):
    ids = http.post("/tokenize", json={"prompt": "round trip", "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "round trip"}
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version, version


def test_bad_tokenizer_calls_are_400_naming_the_field(http):
    for path, body, param in [
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": [10**12]}, "tokens"),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = http.post("/tokenize", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
