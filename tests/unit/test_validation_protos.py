"""The committed gRPC stubs are what ``python -m protos.generate`` makes from the .proto files."""

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
