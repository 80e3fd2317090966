"""The fixtures every test package shares; the plain functions behind them are in
``tests/helpers.py``.

Checkpoints (session): ``tandem_home``, ``default_model``, ``tiny_model``.

A live service, for a module:

- ``ray_cluster``: the session's local Ray (2 CPUs, no dashboard; ``ray_session``, shut
  down when the session ends), cleared when the module ends, so no module sees
  another's actors, Serve app or leftovers. Serve's controller and ingress stay up:
  services run one after another on them (``running_service``).
- ``service``: the whole service on ``tiny_model``, started once per module with the
  keywords of ``running_service`` that the ``service_settings`` fixture returns (none by
  default: a module or package overrides ``service_settings`` to change them).
- ``no_blocks_left``: checks after a test that every worker holds no KV blocks; a
  module asks for it with ``pytestmark = pytest.mark.usefixtures("no_blocks_left")``.
- ``http`` (an httpx client on the service's HTTP URL), ``client`` (the official
  ``openai`` client on it) and ``model_name`` (the served name), ``channel`` and ``stub``
  (gRPC).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cluster.ingress import MIN_DRAIN_S
from tests.helpers import assert_blocks_freed, build_hf_checkpoint, clear_ray, local_ray, running_service

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

# Serve keeps a removed router replica reachable for a while (cluster/ingress.py's
# LOCAL_DRAIN_S, 2 s) so that HAProxy can drop it first; the tests remove one per
# service, with no request in flight.
os.environ.setdefault(MIN_DRAIN_S, "0.3")


# -- tests/gpu ---------------------------------------------------------------------------

_GPU_TESTS = Path(__file__).parent / "gpu"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/gpu runs where it is named (``scripts/gpu-check``, ``pytest tests/gpu``). A run
    of the whole suite runs it once, not twice: in ``tests/unit/test_gpu_image_imports.py``,
    on CPU, with only the GPU image's packages importable."""
    if collection_path != _GPU_TESTS:
        return None
    named = [Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args]
    return None if any(p == _GPU_TESTS or _GPU_TESTS in p.parents for p in named) else True


# -- checkpoints -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tandem_home(tmp_path_factory) -> Path:
    """A private TANDEM_HOME so tests never touch (or depend on) the user's cache."""
    home = tmp_path_factory.mktemp("tandem-home")
    os.environ["TANDEM_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def default_model(tandem_home) -> Path:
    from engine.model.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model) -> str:
    """A 2-layer Llama with the default tokenizer: fast enough for many workers on 2 cores."""
    return str(build_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", default_model, seed=3))


# -- a local Ray and a live service ------------------------------------------------------


@pytest.fixture(scope="session")
def metrics_dir(tmp_path_factory) -> Iterator[str]:
    """Where every Ray process of the session writes its Prometheus metrics.

    The driver points there too, from the first module that starts Ray to the end of
    the session: clusters started here mark their dead workers' gauges in it, and
    prometheus-client fixes where a process writes when it is first imported.
    """
    path = str(tmp_path_factory.mktemp("prometheus-multiproc"))
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    yield path
    if previous is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous


@pytest.fixture(scope="session")
def ray_session(tandem_home, metrics_dir):
    """One local Ray for the session (2 CPUs, no dashboard), shut down when it ends:
    starting and stopping one costs about 10 s of CPU, once per module otherwise."""
    with local_ray(tandem_home, metrics_dir, num_cpus=2) as ray:
        yield ray


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    """The session's Ray for this module, left clean when it ends (``clear_ray``): no
    Serve app, named actor or live actor of the module is there for the next one."""
    yield ray_session
    clear_ray()


@pytest.fixture(scope="module")
def service_settings() -> dict:
    """Keywords for ``running_service`` (router config, workers, KV blocks, topology)."""
    return {}


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_model, service_settings):
    """One live service for the module, as ``service_settings`` describes it."""
    with running_service(tiny_model, **service_settings) as svc:
        yield svc


@pytest.fixture
def no_blocks_left(service):
    """After the test: every worker holds no KV blocks (waiting for late frees)."""
    yield
    assert_blocks_freed(service)


@pytest.fixture(scope="module")
def http(service):
    """An httpx client on the service's HTTP URL."""
    try:  # the HTTP client the installed openai package is built on
        import httpx2 as httpx
    except ImportError:
        import httpx

    with httpx.Client(base_url=service.http_url, timeout=60) as client:
        yield client


@pytest.fixture
def client(service):
    """The official ``openai`` client on the service (no retries: a test sees every error)."""
    import openai

    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(tiny_model) -> str:
    """The name the service serves ``tiny_model`` under: its directory's."""
    return Path(tiny_model).name


@pytest.fixture(scope="module")
def channel(service):
    """A gRPC channel to the service, connected."""
    import grpc

    with grpc.insecure_channel(service.grpc_target) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        yield ch


@pytest.fixture
def stub(channel):
    from protos.tandem.v1 import generate_pb2_grpc

    return generate_pb2_grpc.GenerationStub(channel)
