"""vLLM's extras to the OpenAI API through the live service: the tokenizer endpoints,
``/version``, and the sampling controls (``logit_bias``, ``allowed_token_ids``,
``bad_words``), echo, the prompt's logprobs, and ``priority``, with the official
``openai`` client.

One service (1 prefill + 1 decode worker on the tiny random model, both scheduling by
the ``priority`` policy) for the module, so every request takes the disaggregated path:
the prefill worker samples the first token under the request's controls, the decode
worker the rest. Every test ends with no KV blocks in use anywhere.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("no_blocks_left")


@pytest.fixture(scope="module")
def service_settings():
    return {"prefill_workers": 1, "decode_workers": 1, "engine": {"num_kv_blocks": 512, "policy": "priority"}}


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


# -- the sampling controls ---------------------------------------------------------------


def _single_token_words(tokenizer, words) -> dict[str, int]:
    """The words of ``words`` that are one token each, by id."""
    ids = {w: tokenizer.encode(w, add_special_tokens=False) for w in words}
    return {w: i[0] for w, i in ids.items() if len(i) == 1}


WORDS = [" the", " and", " of", " a", " to", " in", " is", " it", " was", " he"]


def test_logit_bias_and_allowed_token_ids_hold_on_every_token(client, model_name, tokenizer):
    words = _single_token_words(tokenizer, WORDS)
    assert len(words) >= 3, f"the tiny tokenizer should spell a few of {WORDS} as one token: {words}"
    (w0, t0), *rest = words.items()
    pushed = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=6, temperature=0.0,
        logit_bias={str(t0): 100}, extra_body={"ignore_eos": True},
    ).choices[0]
    assert pushed.text == w0 * 6, pushed.text
    allowed = dict(rest)
    for seed in range(4):
        stream = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": f"say something {seed}"}], max_tokens=8,
            temperature=1.0, seed=seed, stream=True,
            extra_body={"allowed_token_ids": list(allowed.values()), "ignore_eos": True},
        )
        pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        text = "".join(pieces)
        assert tokenizer.encode(text, add_special_tokens=False) and all(
            t in allowed.values() for t in tokenizer.encode(text, add_special_tokens=False)), (text, allowed)


def test_bad_words_are_never_completed(client, model_name):
    def greedy(**extra):
        return client.completions.create(
            model=model_name, prompt="The cat sat on the", max_tokens=12, temperature=0.0, logprobs=0,
            extra_body={"ignore_eos": True, **extra},
        ).choices[0]

    plain = greedy()
    tokens = plain.logprobs.tokens
    word = "".join(tokens[2:4])  # what the model writes on its own: the ban has to act
    banned = greedy(bad_words=[word])
    assert banned.logprobs.tokens[:2] == tokens[:2], "the output up to the word is unchanged"
    assert banned.logprobs.tokens[2:4] != tokens[2:4], (word, banned.logprobs.tokens)


def test_bad_sampling_controls_are_400_naming_the_field(client, model_name):
    import openai

    for kwargs, field in [
        ({"logit_bias": {"5": 250}}, "logit_bias"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": [10**9]}}, "allowed_token_ids"),
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
        ({"extra_body": {"bad_words": [" "]}}, "bad_words"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model_name, prompt="hi", max_tokens=3, **kwargs)
        error = e.value.body
        assert error["param"] == field and field in error["message"], (kwargs, error)


def test_grpc_carries_the_controls_and_refuses_bad_ones(stub, tokenizer):
    import grpc

    from protos.tandem.v1 import generate_pb2 as pb

    words = _single_token_words(tokenizer, WORDS)
    allowed = sorted(words.values())[:3]
    request = pb.GenerateRequest(text="over gRPC", sampling=pb.SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed,
        logit_bias={allowed[0]: -100.0}, bad_words=["zebra crossing"]))
    ids = [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]
    assert len(ids) == 8 and set(ids) <= set(allowed[1:]), (ids, allowed)
    for sampling, field in [(pb.SamplingParams(logit_bias={1: 101.0}), "logit_bias"),
                            (pb.SamplingParams(allowed_token_ids=[2**31]), "allowed_token_ids"),
                            (pb.SamplingParams(bad_words=[""]), "bad_words")]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="x", sampling=sampling), timeout=120))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()


# -- priority ----------------------------------------------------------------------------


def test_priority_reaches_both_workers_on_every_endpoint_and_leaves_the_tokens_alone(client, model_name, stub):
    """Under the priority policy a priority orders requests, never changes their tokens:
    each endpoint's greedy output with one equals its output without."""
    from protos.tandem.v1 import generate_pb2 as pb

    kwargs = dict(model=model_name, max_tokens=6, temperature=0.0)
    prompt, messages = "Once upon a time", [{"role": "user", "content": "Once upon a time"}]

    def completion(**extra):
        return [c.text for c in client.completions.create(prompt=prompt, n=2, extra_body={"ignore_eos": True, **extra},
                                                          **kwargs).choices]

    def chat(**extra):
        reply = client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True, **extra}, **kwargs)
        return reply.choices[0].message.content

    def grpc_ids(**extra):
        sampling = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **extra)
        return [t for m in stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=120)
                for t in m.token_ids]

    for run in (completion, chat, grpc_ids):
        plain = run()
        for priority in (-5, 0, 7):
            assert run(priority=priority) == plain, (run.__name__, priority)


def test_a_priority_that_is_not_an_int_is_a_400_naming_it(client, model_name):
    import openai

    for priority in (True, 1.5, "1", 2**31):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model_name, prompt="hi", max_tokens=3, extra_body={"priority": priority})
        assert e.value.body["param"] == "priority" and "priority" in e.value.body["message"], e.value.body


# -- echo --------------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_the_output_whole_and_streamed(client, model_name):
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=6, temperature=0.0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(echo=True, **kwargs)
    assert echoed.choices[0].text == "Once upon a time" + plain, echoed.choices[0].text
    assert echoed.usage.completion_tokens == 6
    chunks = [c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kwargs) if c.choices]
    assert chunks[0].startswith("Once upon a time") and "".join(chunks) == "Once upon a time" + plain, chunks


# -- prompt logprobs ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline_prompt_logprobs(tiny_model):
    """The offline engine's prompt logprobs (checked against HF in the unit tests)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=tiny_model)

    def of(prompt: str, top: int):
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=top))
        return out.prompt_token_ids, out.prompt_logprobs

    return of


def test_prompt_logprobs_come_from_the_prefill_worker_in_vllms_shape(client, model_name, offline_prompt_logprobs):
    ids, want = offline_prompt_logprobs("The cat sat on the mat", 2)
    kwargs = dict(model=model_name, prompt="The cat sat on the mat", max_tokens=3, extra_body={"prompt_logprobs": 2})
    got = client.completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None, got
    for t, entry, lp in zip(ids[1:], got[1:], want[1:]):
        assert str(t) in entry and abs(entry[str(t)]["logprob"] - lp.logprob) < 1e-3, (t, entry, lp)
        assert entry[str(t)]["rank"] == lp.rank and len(set(entry) - {str(t)}) <= 2, entry
    first, *_ = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert first.choices[0].model_extra["prompt_logprobs"] == got, "a stream opens with the prompt's logprobs"
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    plps = chat.model_extra["prompt_logprobs"]
    assert len(plps) == chat.usage.prompt_tokens and plps[0] is None and all(len(e) == 1 for e in plps[1:]), plps


def test_echo_with_logprobs_puts_the_prompts_before_the_outputs(client, model_name, offline_prompt_logprobs):
    prompt = "Once upon a time"
    ids, want = offline_prompt_logprobs(prompt, 1)
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=4, temperature=0.0, echo=True, logprobs=1,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    lps = whole.logprobs
    assert len(lps.tokens) == len(ids) + 4 and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None, lps
    for got, lp in zip(lps.token_logprobs[1 : len(ids)], want[1:]):
        assert abs(got - lp.logprob) < 1e-3, (got, lp)
    assert lps.text_offset == sorted(lps.text_offset) and lps.text_offset[0] == 0, lps.text_offset
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert [t for s in streamed if s for t in s.token_logprobs] == lps.token_logprobs
    assert "".join(c for s in streamed if s for c in s.tokens) == "".join(lps.tokens)


# -- several prompts in one request ------------------------------------------------------


def test_a_list_of_prompts_gives_a_choice_each_whole_and_streamed(client, model_name):
    prompts = ["Once upon a time", "The cat sat on the", "1 2 3 4"]
    kwargs = dict(model=model_name, max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    out = client.completions.create(prompt=prompts, echo=True, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2], out.choices
    for p, a, c in zip(prompts, alone, out.choices):
        assert c.text == p + a.choices[0].text and c.finish_reason == "length", (c, a)
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == 15
    texts = ["", "", ""]
    stream = client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [a.choices[0].text for a in alone], texts
    assert chunks[-1].usage.completion_tokens == 15


def test_leaving_a_stream_of_several_prompts_early_frees_every_request(http, model_name):
    body = {"model": model_name, "prompt": ["a", "b", "c", "d"], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up: no_blocks_left checks all four were aborted
