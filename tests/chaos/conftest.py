"""Chaos tests run a live service each: one local Ray for the package (see
tests/fuzz/conftest.py), the integration tests' tiny checkpoint, and the session's
metrics folder."""

from __future__ import annotations

import pytest

from tests.fuzz.conftest import local_ray, tiny_checkpoint
from tests.integration.conftest import metrics_dir  # noqa: F401  (a session fixture, re-exported)


@pytest.fixture(scope="package")
def ray_cluster(tandem_home, metrics_dir):  # noqa: F811
    with local_ray(tandem_home, metrics_dir) as ray:
        yield ray


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model) -> str:
    return tiny_checkpoint(tmp_path_factory, default_model)
