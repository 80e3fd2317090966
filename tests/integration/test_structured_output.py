"""Structured output through the live service with the official ``openai`` client.

One service (1 prefill + 1 decode worker on the tiny random model) for the module, so
each constrained request takes the disaggregated path: the prefill worker samples the
first token under the grammar and the decode worker replays it into its own matcher
before going on. Every test ends with no KV blocks in use anywhere.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.usefixtures("no_blocks_left")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "color", "sizes", "ok"],
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["apple", "banana split", "cherry"]
PROMPTS = [f"request {i}: {w}" for i, w in enumerate("one two three four five six seven eight nine ten".split() * 2)]


@pytest.fixture(scope="module")
def service_settings():
    return {"prefill_workers": 1, "decode_workers": 1}  # disaggregated: the KV and first token move


def _validate(value: dict) -> None:
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(SCHEMA["required"]), value
        assert isinstance(value["name"], str) and len(value["name"]) <= 6, value
        assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool), value
        assert len(value["sizes"]) <= 3 and all(isinstance(s, int) and 0 <= s <= 99 for s in value["sizes"])
        return
    jsonschema.validate(value, SCHEMA)


def _many(fn, n: int = 20) -> list:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, PROMPTS[:n], range(n)))


def test_chat_json_schema_requests_return_valid_json(client, model_name):
    def one(prompt, i):
        return client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120,
            temperature=0.0 if i % 2 == 0 else 1.0,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}},
        ).choices[0]

    for choice in _many(one):
        assert choice.finish_reason == "stop", f"{choice.finish_reason}: {choice.message.content!r}"
        _validate(json.loads(choice.message.content))


def test_completion_regex_and_choice_requests_match(client, model_name):
    def regex(prompt, i):
        return client.completions.create(
            model=model_name, prompt=prompt, max_tokens=30, temperature=1.0, seed=i, extra_body={"guided_regex": REGEX}
        ).choices[0]

    def choice(prompt, i):
        return client.completions.create(
            model=model_name, prompt=prompt, max_tokens=30, temperature=1.0, seed=i,
            extra_body={"guided_choice": CHOICES},
        ).choices[0]

    for out in _many(regex):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), (out.finish_reason, out.text)
    picked = [out.text for out in _many(choice)]
    assert all(text in CHOICES for text in picked), picked


def test_streamed_guided_json_is_valid_json(client, model_name):
    stream = client.completions.create(
        model=model_name, prompt="stream me", max_tokens=120, temperature=0.0, stream=True,
        extra_body={"guided_json": SCHEMA},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    _validate(json.loads(text))


def test_invalid_specs_are_400_naming_the_field(client, model_name):
    import openai

    cases = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= nowhere"}}, "guided_grammar"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
        # Issue 53: 36 s of xgrammar's parse before the bound, and a RecursionError (500).
        ({"extra_body": {"guided_json": {"type": "string", "pattern": "[a-z]{1,20000}"}}}, "guided_json"),
        ({"extra_body": {"guided_json": "[" * 50_000 + "]" * 50_000}}, "guided_json"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=5, **kwargs
            )
        error = e.value.body
        assert error["param"] == field and field in error["message"], (kwargs, error)


def test_grpc_guided_regex_matches_and_a_bad_one_is_invalid_argument(stub):
    import grpc

    from protos.tandem.v1 import generate_pb2 as pb

    request = pb.GenerateRequest(
        text="over gRPC", sampling=pb.SamplingParams(max_tokens=30, temperature=0.0, guided_regex=REGEX)
    )
    text = "".join(m.text for m in stub.Generate(request, timeout=120))
    assert re.fullmatch(REGEX, text), text
    bad = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=5, guided_regex="(unclosed"))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, timeout=120))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guided_regex" in e.value.details()
