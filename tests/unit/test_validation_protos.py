"""The committed gRPC stubs are what ``python -m protos.generate`` makes from the .proto files,
and the messages the router builds from them."""

from __future__ import annotations

import pytest


def test_committed_grpc_stubs_match_the_proto_files():
    pytest.importorskip("grpc_tools")
    from protos.generate import stale_stubs

    stale = stale_stubs()
    assert not stale, f"regenerate with `python -m protos.generate`; stale: {stale}"


def test_the_service_exposes_generate_abort_and_model_info():
    from protos.tandem.v1 import generate_pb2

    service = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Abort", "GetModelInfo"}
    assert methods["Generate"].server_streaming
    assert generate_pb2.DESCRIPTOR.package == "tandem.v1"


def test_a_response_carries_its_choice_index_and_one_prompt_logprob_per_prompt_token():
    pytest.importorskip("grpc")
    from engine.wire.messages import StreamDelta
    from router import grpc_api

    prompt = [11, 22, 33]
    entries = [None, (22, -1.5, 3, [(7, -0.5), (22, -1.5)]), (33, -0.25, 1, [(33, -0.25)])]
    delta = StreamDelta("r-2", [5], "x", False, num_prompt_tokens=3, num_output_tokens=1, prompt_logprobs=entries)
    msg = grpc_api.response(delta, "r", prompt, index=2)
    assert (msg.request_id, msg.index, list(msg.token_ids)) == ("r", 2, [5]), "the call's id, the choice's index"
    got = [(p.token_id, p.logprob if p.HasField("logprob") else None, p.rank,
            [(t.token_id, t.logprob) for t in p.top]) for p in msg.prompt_logprobs]
    assert got == [(11, None, 0, []), (22, -1.5, 3, [(7, -0.5), (22, -1.5)]), (33, -0.25, 1, [(33, -0.25)])], got
    later = grpc_api.response(delta._replace(prompt_logprobs=None), "r", prompt, index=2)
    assert not later.prompt_logprobs, "only a choice's first message carries the prompt's logprobs"
