"""``OutputProcessor``: sampled tokens in, ``RequestOutput`` deltas out, without a model or a
scheduler (requests are made by hand and finished as the engine would)."""

from __future__ import annotations

import pytest

from engine.core.request import Request, RequestStatus
from engine.model.sampler import TokenLogprobs
from engine.output_processor import OutputProcessor
from engine.structured_output import StructuredOutputs
from engine.tokenizer import Tokenizer
from engine.wire.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model)


@pytest.fixture
def processor(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer, StructuredOutputs(tokenizer, 1024, tokenizer.eos_token_ids))


def _feed(processor: OutputProcessor, request: Request, token: int, lp: TokenLogprobs | None = None) -> list[str]:
    """One step that sampled ``token`` for ``request``, as the scheduler's update leaves it."""
    request.output_token_ids.append(token)
    return processor.update([request], {request.request_id: token}, {request.request_id: lp} if lp else {}, 1.0)


def test_each_output_carries_only_its_step_and_the_final_one_the_whole_output(processor, tokenizer):
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    request = Request("r", tokenizer.encode("Count:"), SamplingParams(logprobs=0), arrival_time=0.0)
    processor.add(request)
    texts = []
    for token in ids:
        assert _feed(processor, request, token, TokenLogprobs(token, -0.5, ())) == []
        out = processor.output(request)
        assert out.new_token_ids == [token] and out.token_ids == [], "a step's delta, not the whole output"
        assert [lp.token_id for lp in out.new_logprobs] == [token]
        texts.append(out.new_text)
        assert request.first_token_time == 1.0
    request.status = RequestStatus.FINISHED_LENGTH
    final = processor.final(request, now=3.0)
    assert "".join(texts) + final.new_text == " one two three"
    assert final.token_ids == ids and [lp.token_id for lp in final.logprobs] == ids
    assert final.finished and final.finish_reason == "length" and final.times.e2e_s == 3.0
    assert "r" not in processor, "a final output forgets the request"


def test_a_stop_string_asks_to_stop_and_cuts_the_text_before_it(processor, tokenizer):
    request = Request("r", tokenizer.encode("Say:"), SamplingParams(stop=["two"]))
    processor.add(request)
    stopped = [rid for t in tokenizer.encode(" one two three", add_special_tokens=False)
               for rid in _feed(processor, request, t)]
    assert stopped == ["r"], "the step whose text completes the stop string stops the request"
    assert request.stop_reason == "two"
    request.status = RequestStatus.FINISHED_STOPPED
    assert processor.final(request, now=1.0).text == " one "


def test_a_migrated_stream_does_not_send_again_what_its_first_worker_sent(processor, tokenizer):
    sent = tokenizer.encode(" one two", add_special_tokens=False)
    request = Request("r", tokenizer.encode("Count:"), SamplingParams(prompt_logprobs=1),
                      output_token_ids=list(sent))
    processor.add(request, resume_output=sent)
    (token,) = tokenizer.encode(" three", add_special_tokens=False)
    _feed(processor, request, token)
    out = processor.output(request)
    assert out.new_token_ids == [token] and out.new_text == " three"
    assert out.prompt_logprobs is None, "the worker it came from delivered the prompt's logprobs"
