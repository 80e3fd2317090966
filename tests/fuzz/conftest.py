"""The fuzz modules' live service, one for the package (a small body limit), and the
oracle they judge its answers by."""

from __future__ import annotations

import pytest

from tests.helpers import clear_ray, running_service

MAX_BODY = 64 * 1024  # small, so the fuzzers reach the body limit often


@pytest.fixture(scope="package")
def service(ray_session, tiny_model):
    """One live service for both fuzzers; the session's Ray is cleared after them."""
    from router.server import RouterConfig

    with running_service(tiny_model, router=RouterConfig(max_body_bytes=MAX_BODY), num_kv_blocks=256) as svc:
        yield svc
    clear_ray()


@pytest.fixture(scope="module")
def oracle(service):
    """The served model's limits and tokenizer, for running the router's validation locally."""
    from engine.tokenizer import Tokenizer
    from router.validation import ServedModel

    info = dict(service.model_info)
    tokenizer = Tokenizer.from_pretrained(info.pop("model_dir"))
    return ServedModel(**info), tokenizer
