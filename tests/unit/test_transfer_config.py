"""Transfer settings applied to a backend: at start, and again on a running worker."""

from __future__ import annotations

import pytest

from kv_transfer.config import TransferConfig
from kv_transfer.faults import FaultConfig, FaultyBackend


def test_settings_switch_faults_on_and_off_around_the_same_backend():
    bare = TransferConfig(backend="inprocess").make_backend()
    assert not isinstance(bare, FaultyBackend)

    faulty = TransferConfig(backend="inprocess", faults=FaultConfig(drop_rate=0.5)).configure(bare)
    assert isinstance(faulty, FaultyBackend) and faulty.inner is bare and faulty.faults.drop_rate == 0.5

    slower = TransferConfig(backend="inprocess", faults=FaultConfig(delay_s=1.0)).configure(faulty)
    assert slower.inner is bare and slower.faults == FaultConfig(delay_s=1.0), "faults replace, never stack"

    assert TransferConfig(backend="inprocess").configure(slower) is bare


def test_the_collective_backend_takes_its_operation_deadline():
    backend = TransferConfig(backend="collective", op_timeout_s=60).make_backend()
    try:
        assert TransferConfig(backend="collective", op_timeout_s=7).configure(backend) is backend
        assert backend.op_timeout_s == 7
    finally:
        backend.close()


def test_settings_of_another_backend_are_refused():
    bare = TransferConfig(backend="inprocess").make_backend()
    with pytest.raises(ValueError, match="inprocess backend cannot take object_store settings"):
        TransferConfig(backend="object_store").configure(bare)


def test_settings_from_a_mapping_take_faults_as_a_mapping_and_name_an_unknown_key():
    config = TransferConfig.from_dict({"backend": "inprocess", "timeout_s": 2, "faults": {"drop_rate": 0.25}})
    assert config == TransferConfig(backend="inprocess", timeout_s=2, faults=FaultConfig(drop_rate=0.25))
    with pytest.raises(ValueError, match="timeout_ms"):
        TransferConfig.from_dict({"backend": "inprocess", "timeout_ms": 2})
