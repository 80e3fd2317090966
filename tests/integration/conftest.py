"""One local Ray per test session, shut down at the end; small checkpoints for speed."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster(tandem_home):
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"TANDEM_HOME": str(tandem_home), "OMP_NUM_THREADS": "1"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model):
    """A 2-layer Llama with the default tokenizer: fast enough for many workers on 2 cores."""
    from tests.conftest import build_hf_checkpoint

    return str(build_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", default_model, seed=3))
