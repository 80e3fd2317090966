"""Fixtures for the modules that run a live service outside tests/integration.

``ray_cluster`` here is package-scoped: the package's modules share one local Ray,
shut down when the package is done, so that tests/integration's session-scoped Ray
can start after it. If a Ray is already up (tests/integration ran first in this
session), it is shared and left running. ``tiny_model`` is the integration tests'
checkpoint, built once per session whichever package asks first.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.integration.conftest import metrics_dir  # noqa: F401  (a session fixture, re-exported)

_BUILT: dict[str, str] = {}


@contextlib.contextmanager
def local_ray(tandem_home, metrics_path: str):
    """A local Ray like tests/integration's (2 CPUs, no dashboard), or the one already up."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_path
    env = {"TANDEM_HOME": str(tandem_home), "OMP_NUM_THREADS": "1", "PROMETHEUS_MULTIPROC_DIR": metrics_path}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env})
    try:
        yield ray
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous


def tiny_checkpoint(tmp_path_factory, default_model) -> str:
    """tests/integration's ``tiny_model`` (same seed and shape), built once per session."""
    if "tiny" not in _BUILT:
        from tests.conftest import build_hf_checkpoint

        out = tmp_path_factory.mktemp("tiny-llama")
        _BUILT["tiny"] = str(build_hf_checkpoint(out, "llama", default_model, seed=3))
    return _BUILT["tiny"]


@pytest.fixture(scope="package")
def ray_cluster(tandem_home, metrics_dir):  # noqa: F811
    with local_ray(tandem_home, metrics_dir) as ray:
        yield ray


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model) -> str:
    return tiny_checkpoint(tmp_path_factory, default_model)


MAX_BODY = 64 * 1024  # small, so the fuzzers reach the body limit often


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_model):
    """One live service per fuzz module, with the small body limit."""
    from router.server import RouterConfig
    from tests.integration.conftest import running_service

    with running_service(tiny_model, RouterConfig(max_body_bytes=MAX_BODY), num_kv_blocks=256) as svc:
        yield svc


@pytest.fixture(scope="module")
def oracle(service):
    """The served model's limits and tokenizer, for running the router's validation locally."""
    from engine.tokenizer import Tokenizer
    from router.validation import ServedModel

    info = dict(service.model_info)
    tokenizer = Tokenizer.from_pretrained(info.pop("model_dir"))
    return ServedModel(**info), tokenizer
